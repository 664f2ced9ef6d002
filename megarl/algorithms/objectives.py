"""Policy objectives and advantage estimators users switch between (beyond PPO / GRPO).

Policy losses (``algorithm.policy_loss``, registry ``POLICY_LOSSES``): gspo, gspo_token, cispo,
sapo, clip_cov, kl_cov, gmpo, gpg. Advantage estimators (``algorithm.advantage``, registry
``ADVANTAGES``): remax, opo, gpg.

Every policy loss has the uniform call of `losses.policy_loss`:

    loss, metrics = fn(log_probs, old_log_probs, advantages, mask, clip_low, clip_high, clip_c,
                       agg=..., global_tokens=..., global_seqs=..., max_len=..., **objective_params)

The three positional PPO clip arguments are accepted and ignored (each objective has its own,
differently scaled, parameters, passed as keywords; `CONFIG_KWARGS` names the config field behind
each keyword). Denominators follow `losses.agg_loss`: pass the counts of the whole optimizer
mini-batch so that micro-batch losses add up (docs/algorithms.md §1.2). Shapes: [B, T] per token, `mask`
[B, T] 1 on tokens that count; a row whose mask is all 0 (empty response) contributes nothing.

Metrics are detached 0-dim tensors over the local masked tokens (as in `losses.policy_loss`):
approx_kl (k3), approx_kl_k1, ratio_mean/max/min of the token ratio rho = exp(logp - logp_old),
n_tokens, plus objective-specific fractions documented per function.
"""

from __future__ import annotations

import torch

from .estimators import AdvantageInputs, AdvantageParams, _need, _scores
from .losses import LOG_RATIO_CLAMP, Count, _base_metrics, _check_shapes, _count, _log_ratio_and_ratio, _msum, agg_loss
from .outcome import _group_stats, _scores_1d, broadcast_to_tokens
from .registry import ADVANTAGES, POLICY_LOSSES

# policy loss name -> {keyword of the function: field of AlgorithmConfig}
CONFIG_KWARGS: dict[str, dict[str, str]] = {
    "gspo": {"eps_low": "gspo_clip_low", "eps_high": "gspo_clip_high"},
    "gspo_token": {"eps_low": "gspo_clip_low", "eps_high": "gspo_clip_high"},
    "cispo": {"eps_low": "cispo_clip_low", "eps_high": "cispo_clip_high"},
    "sapo": {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"},
    "clip_cov": {"ratio": "clip_cov_ratio", "lb": "clip_cov_lb", "ub": "clip_cov_ub"},
    "kl_cov": {"ratio": "kl_cov_ratio", "kl_coef": "kl_cov_coef"},
    "gmpo": {"eps_low": "gmpo_clip_low", "eps_high": "gmpo_clip_high"},
    "gpg": {},
}


def _seq_sum(per_seq: torch.Tensor, m: torch.Tensor, global_seqs: Count) -> torch.Tensor:
    """sum_i per_seq_i over rows with >= 1 token / N_seq (global_seqs, or the local number of such rows)."""
    has = (m.sum(-1) > 0).to(per_seq.dtype)
    den = has.sum().clamp(min=1.0) if global_seqs is None else global_seqs
    return (per_seq * has).sum() / den


# ---- GSPO -------------------------------------------------------------------------------------------
def _gspo(token_level: bool, log_probs, old_log_probs, advantages, mask, eps_low, eps_high, global_seqs):
    name = "gspo_token" if token_level else "gspo"
    _check_shapes(name, log_probs, old_log_probs, advantages, mask)
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"{name}: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    m = mask.to(log_probs.dtype)
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    seq_log = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (1/|y_i|) sum_t log rho_{i,t}
    seq_log = seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if token_level:  # log s_{i,t} = sg[log s_i] + log pi_t - sg[log pi_t]
        log_s = seq_log.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    else:
        log_s = seq_log.unsqueeze(-1).expand_as(log_probs)
    s = torch.exp(log_s)
    neg_adv = -advantages.to(log_probs.dtype)
    per_token = torch.maximum(neg_adv * s, neg_adv * s.clamp(1.0 - eps_low, 1.0 + eps_high))
    loss = agg_loss(per_token, mask, "seq-mean-token-mean", global_seqs=global_seqs)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
        s = s.detach()
        pos, neg = (neg_adv < 0).logical_and_(mb), (neg_adv > 0).logical_and_(mb)
        high = _count(s > 1.0 + eps_high, pos) / n
        low = _count(s < 1.0 - eps_low, neg) / n
        metrics.update(clipfrac_high=high, clipfrac_low=low, clipfrac=high + low,
                       seq_ratio_mean=_msum(s, m) / n)
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *_ppo_clip, agg: str = "seq-mean-token-mean", global_tokens: Count = None, global_seqs: Count = None,
              max_len: int | None = None, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071). -> (loss, metrics).

    Sequence-level ratio s_i = exp((1/|y_i|) sum_t m (logp - logp_old)) (the length-normalised
    sequence likelihood ratio; |y_i| = the row's valid tokens, the mean clamped to +-20);
    l_{i,t} = max(-A_{i,t} s_i, -A_{i,t} clip(s_i, 1 - eps_low, 1 + eps_high)); loss aggregated
    seq-mean-token-mean whatever `agg` says (paper eq. 5; verl does the same): sum_i (mean_t l) / N_seq
    with N_seq = global_seqs. Paper clip range: eps_low 3e-4, eps_high 4e-4. With one advantage per
    sequence (GRPO's) the loss is -A_i s_i (clipped) per sequence. Metrics: clipfrac_high =
    frac(A > 0 and s > 1+eps_high), clipfrac_low = frac(A < 0 and s < 1-eps_low) (token-weighted),
    clipfrac, seq_ratio_mean (token-weighted mean of s_i), plus the common ratio metrics.
    """
    return _gspo(False, log_probs, old_log_probs, advantages, mask, eps_low, eps_high, global_seqs)


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, *_ppo_clip, agg: str = "seq-mean-token-mean", global_tokens: Count = None,
                    global_seqs: Count = None, max_len: int | None = None, eps_low: float = 3e-4,
                    eps_high: float = 4e-4):
    """GSPO-token (arXiv 2507.18071, eq. 13-14): as `gspo_loss` with the per-token ratio
    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], i.e. log s_{i,t} = sg[log s_i] + logp_t - sg[logp_t].

    Equal to s_i in value (same loss and metrics as GSPO); its gradient is s_i * grad logp_t per
    token, so per-token advantages A_{i,t} weigh each token's gradient. With A constant over a
    sequence the gradient equals GSPO's.
    """
    return _gspo(True, log_probs, old_log_probs, advantages, mask, eps_low, eps_high, global_seqs)


# ---- CISPO ------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("cispo")
def cispo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               *_ppo_clip, agg: str = "token-mean", global_tokens: Count = None, global_seqs: Count = None,
               max_len: int | None = None, eps_low: float | None = None, eps_high: float = 0.2):
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv 2506.13585, eq. 4-5). -> (loss, metrics).

    w_t = sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) with rho_t = exp(clamp(logp - logp_old, +-20));
    l_t = -w_t * A_t * logp_t; loss = token-mean (sum m*l / global_tokens) whatever `agg` says (the
    paper normalises by the total token count of the batch). The weight is clipped, never the
    update: every token keeps the gradient -w_t A_t grad logp_t, including tokens whose ratio is
    clipped. eps_low=None: no lower bound (the paper sets eps_low^IS "large"; only eps_high^IS is
    tuned, value not stated; 0.2 follows verl's CISPO example). Metrics: clipfrac_high =
    frac(rho > 1+eps_high), clipfrac_low = frac(rho < 1-eps_low), clipfrac (tokens whose weight is
    clipped, any advantage sign), plus the common ratio metrics.
    """
    _check_shapes("cispo", log_probs, old_log_probs, advantages, mask)
    if eps_high < 0 or (eps_low is not None and eps_low < 0):
        raise ValueError(f"cispo: need eps_low >= 0 (or None) and eps_high >= 0, got {eps_low}, {eps_high}")
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    lo = None if eps_low is None else 1.0 - eps_low
    w = ratio.detach().clamp(min=lo, max=1.0 + eps_high)
    per_token = -w * advantages.to(log_probs.dtype) * log_probs
    loss = agg_loss(per_token, mask, "token-mean", global_tokens=global_tokens)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
        high = _count(ratio.detach() > 1.0 + eps_high, mb) / n
        low = _count(ratio.detach() < lo, mb) / n if lo is not None else torch.zeros_like(high)
        metrics.update(clipfrac_high=high, clipfrac_low=low, clipfrac=high + low)
    return loss, metrics


# ---- SAPO -------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("sapo")
def sapo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *_ppo_clip, agg: str = "seq-mean-token-mean", global_tokens: Count = None, global_seqs: Count = None,
              max_len: int | None = None, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO, soft adaptive policy optimization (Gao et al., arXiv 2511.20347). -> (loss, metrics).

    Soft gate instead of a hard clip: f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau = tau_pos where
    A > 0 and tau_neg where A <= 0; l_t = -f(rho_t) A_t; loss aggregated seq-mean-token-mean whatever
    `agg` says (the paper's objective averages tokens within a response, then responses). f(1) = 2/tau
    and f'(1) = 1, so on-policy the gradient is plain -A grad logp; it decays smoothly as rho leaves 1,
    faster for the larger tau. Paper defaults tau_pos = 1.0, tau_neg = 1.05 (tau_neg > tau_pos damps
    negative-advantage updates more). Metrics: gate_mean (mean f(rho)), plus the common ratio metrics.
    """
    _check_shapes("sapo", log_probs, old_log_probs, advantages, mask)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo: temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    adv = advantages.to(log_probs.dtype)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = agg_loss(-gate * adv, mask, "seq-mean-token-mean", global_seqs=global_seqs)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
        metrics["gate_mean"] = _msum(gate.detach(), mask.to(log_probs.dtype)) / n
    return loss, metrics


# ---- Clip-Cov / KL-Cov ------------------------------------------------------------------------------
def token_covariance(log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cov_t = (logp_t - mean logp) * (A_t - mean A), means over the masked tokens passed in; detached.

    (arXiv 2505.22617, eq. for Clip-Cov / KL-Cov.) Masked-out positions get -inf so they never rank
    or fall in a range. The statistics are those of the tokens handed in: one micro-batch in the
    trainer (as verl, which computes them inside the loss of each micro-batch)."""
    m = mask.to(log_probs.dtype)
    n = m.sum().clamp(min=1.0)
    lp, a = log_probs.detach(), advantages.detach().to(log_probs.dtype)
    cov = (lp - _msum(lp, m) / n) * (a - _msum(a, m) / n)
    return cov.masked_fill(~mask.bool(), float("-inf"))


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  *_ppo_clip, agg: str = "token-mean", global_tokens: Count = None, global_seqs: Count = None,
                  max_len: int | None = None, ratio: float = 2e-4, lb: float = 1.0, ub: float = 5.0,
                  generator: torch.Generator | None = None):
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617). -> (loss, metrics).

    Cov_t = (logp_t - mean logp) * (A_t - mean A) (`token_covariance`); the candidates are the masked
    tokens with lb < Cov_t < ub; k = max(1, floor(ratio * N)) of them (N = masked tokens) are drawn
    uniformly at random (`generator`, default the global torch RNG) and their gradient is detached.
    l_t = -A_t * rho_t with rho detached on the drawn tokens (value unchanged, gradient 0); loss =
    agg_loss(l, mask, agg, ...) (`algorithm.loss_agg`). The surrogate is the paper's unclipped
    -A rho (Clip-Cov replaces PPO's clip; verl's port keeps the PPO clip as well and only draws
    among unclipped tokens).

    Which tokens the statistics cover: the means, N and k are over the masked tokens of the call,
    i.e. one micro-batch in the trainer, as in verl's implementation (the covariance only selects
    tokens, it carries no gradient, so a per-micro-batch selection keeps the loss additive over
    micro-batches; a global top fraction would need the Cov values of the whole mini-batch).
    Defaults ratio 2e-4, lb 1, ub 5 (the paper's / verl's). Metrics: cov_detached_frac (drawn
    tokens / N), cov_mean, plus the common ratio metrics.
    """
    _check_shapes("clip_cov", log_probs, old_log_probs, advantages, mask)
    if not (0.0 < ratio <= 1.0 and lb < ub):
        raise ValueError(f"clip_cov: need 0 < ratio <= 1 and lb < ub, got ratio={ratio}, lb={lb}, ub={ub}")
    log_ratio, rho = _log_ratio_and_ratio(log_probs, old_log_probs)
    cov = token_covariance(log_probs, advantages, mask)
    cand = ((cov > lb) & (cov < ub) & mask.bool()).reshape(-1).nonzero().squeeze(-1)
    n_tok = int(mask.bool().sum())
    k = min(max(1, int(ratio * n_tok)), cand.numel())
    detach = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if k > 0:
        pick = torch.randperm(cand.numel(), generator=generator, device="cpu")[:k].to(cand.device)
        detach[cand[pick]] = True
    detach = detach.view_as(mask)
    rho_g = torch.where(detach, rho.detach(), rho)
    loss = agg_loss(-advantages.to(log_probs.dtype) * rho_g, mask, agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, rho, mask, log_probs.dtype)
        m = mask.to(log_probs.dtype)
        metrics["cov_detached_frac"] = _count(detach.clone(), mb) / n
        metrics["cov_mean"] = _msum(torch.where(mb, cov, torch.zeros_like(cov)), m) / n
    return loss, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *_ppo_clip, agg: str = "token-mean", global_tokens: Count = None, global_seqs: Count = None,
                max_len: int | None = None, ratio: float = 2e-4, kl_coef: float = 1.0):
    """KL-Cov (arXiv 2505.22617). -> (loss, metrics).

    Cov_t as in `clip_cov_loss` (same statistics: the masked tokens of the call, one micro-batch);
    the top k = max(1, floor(ratio * N)) masked tokens by Cov_t get a KL penalty:
    l_t = -A_t rho_t + kl_coef * |logp_t - logp_old_t| on them, l_t = -A_t rho_t elsewhere (no clip);
    loss = agg_loss(l, mask, agg, ...). Defaults: ratio 2e-4 (paper: 2e-3 for Qwen2.5-7B, 2e-4 for
    32B; verl's default 2e-4), kl_coef 1 (paper / verl). Metrics: kl_cov_frac (penalised tokens / N),
    kl_cov_abs_kl (mean |logp - logp_old| over all masked tokens), plus the common ratio metrics.
    """
    _check_shapes("kl_cov", log_probs, old_log_probs, advantages, mask)
    if not (0.0 < ratio <= 1.0 and kl_coef >= 0):
        raise ValueError(f"kl_cov: need 0 < ratio <= 1 and kl_coef >= 0, got ratio={ratio}, kl_coef={kl_coef}")
    log_ratio, rho = _log_ratio_and_ratio(log_probs, old_log_probs)
    cov = token_covariance(log_probs, advantages, mask)
    n_tok = int(mask.bool().sum())
    pen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if n_tok > 0:
        pen[torch.topk(cov.reshape(-1), max(1, int(ratio * n_tok))).indices] = True
    pen = pen.view_as(mask)
    abs_kl = (log_probs - old_log_probs).abs()
    per_token = -advantages.to(log_probs.dtype) * rho + kl_coef * abs_kl * pen.to(log_probs.dtype)
    loss = agg_loss(per_token, mask, agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, rho, mask, log_probs.dtype)
        metrics["kl_cov_frac"] = _count(pen.clone(), mb) / n
        metrics["kl_cov_abs_kl"] = _msum(abs_kl.detach(), mask.to(log_probs.dtype)) / n
    return loss, metrics


# ---- GMPO -------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("gmpo")
def gmpo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *_ppo_clip, agg: str = "seq-mean-token-mean", global_tokens: Count = None, global_seqs: Count = None,
              max_len: int | None = None, eps_low: float = 0.4, eps_high: float = 0.4):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673). -> (loss, metrics).

    The geometric mean of the token terms instead of GRPO's arithmetic mean, clipped per token in
    log space before the mean: with x_t = logp_t - logp_old_t and sgn = sign(A_t),
    x'_t = sgn * min(sgn x_t, sgn clip(x_t, -eps_low, eps_high)) (PPO's pessimistic side, so the
    ratio range is (e^-eps_low, e^eps_high)); R_i = exp((1/|o_i|) sum_t m x'_t); A_i = the mean of
    A over the row's valid tokens (the paper's advantage is per sequence); l_i = -A_i R_i;
    loss = sum_i l_i / N_seq (the paper's 1/G sum over responses; N_seq = global_seqs; `agg` is
    not used). Paper default eps 0.4 each side, i.e. ratios in (e^-0.4, e^0.4). Not stated in the
    paper and chosen here: averaging token advantages into A_i (verl does the same).
    Metrics: clipfrac_high = frac(A > 0 and x > eps_high), clipfrac_low = frac(A < 0 and
    x < -eps_low), clipfrac, plus the common ratio metrics. These are exactly the tokens where
    x'_t != x_t, i.e. where the paper's sign-aware clip is active and the token has no gradient
    (checked against the paper; verl's port instead counts every token outside the range by the
    sign of A, including A > 0 with x < -eps_low, where the objective is not clipped).
    Micro-batching: R_i needs every token of row i in one call; the trainer's micro-batches hold
    whole rows (context-parallel shards are summed back into full rows before the loss), so with
    global_seqs the micro-batch losses add up to the full-batch loss for any split.
    """
    _check_shapes("gmpo", log_probs, old_log_probs, advantages, mask)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"gmpo: need eps_low >= 0 and eps_high >= 0, got {eps_low}, {eps_high}")
    m = mask.to(log_probs.dtype)
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    adv = advantages.to(log_probs.dtype)
    sgn = torch.sign(adv)
    x_min = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio.clamp(-eps_low, eps_high))
    length = m.sum(-1).clamp(min=1.0)
    seq_ratio = torch.exp((x_min * m).sum(-1) / length)
    seq_adv = (adv * m).sum(-1) / length
    loss = _seq_sum(-seq_adv * seq_ratio, m, global_seqs)
    with torch.no_grad():
        metrics, mb, count, n = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
        lr = log_ratio.detach()
        pos, neg = (adv > 0).logical_and_(mb), (adv < 0).logical_and_(mb)
        high, low = _count(lr > eps_high, pos) / n, _count(lr < -eps_low, neg) / n
        metrics.update(clipfrac_high=high, clipfrac_low=low, clipfrac=high + low)
    return loss, metrics


# ---- GPG --------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("gpg")
def gpg_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             *_ppo_clip, agg: str = "token-mean", global_tokens: Count = None, global_seqs: Count = None,
             max_len: int | None = None):
    """GPG, Group Policy Gradient (Chu et al., arXiv 2504.02546), policy loss. -> (loss, metrics).

    The plain policy-gradient objective, no surrogate ratio and no clip: l_t = -A_t * logp_t;
    loss = agg_loss(l, mask, agg, ...) (the paper: token-mean, 1/sum_i |o_i|, which is
    `algorithm.loss_agg`'s default). Pair it with `algorithm.advantage=gpg` (the corrected group
    advantage). Metrics: the common ratio metrics (rho is reported, not used).
    """
    _check_shapes("gpg", log_probs, old_log_probs, advantages, mask)
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    loss = agg_loss(-advantages.to(log_probs.dtype) * log_probs, mask, agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        metrics, *_ = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
    return loss, metrics


# ---- advantage estimators ---------------------------------------------------------------------------
@ADVANTAGES.register("remax")
def remax_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., arXiv 2310.10505): A_i = s_i - b_i with b_i = the reward of the greedy
    response to the same prompt (`AdvantageInputs.baseline_scores` [B]; the rollout generates that
    greedy sample, which is not trained on). s_i = sum_t m r (outcome score plus any per-token
    reward terms); A_i is broadcast to every masked token. Returns = advantages."""
    base = _need(inputs, "baseline_scores", "remax")
    s = _scores(inputs)
    if base.shape != s.shape:
        raise ValueError(f"remax: baseline_scores has shape {tuple(base.shape)}, expected {tuple(s.shape)}")
    adv = broadcast_to_tokens(s - base.to(s.dtype), inputs.mask)
    return adv, adv


def opo_advantages(scores: torch.Tensor, lengths: torch.Tensor, group_index) -> torch.Tensor:
    """OPO (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585), [N]:
    A_i = s_i - b_g, b_g = sum_{j in g} |o_j| s_j / sum_{j in g} |o_j| (the length-weighted group
    mean, the variance-optimal baseline for sequence-level rewards). A group of size 1 gets
    b = 0 (as GRPO's mean and verl's OPO); a group whose responses are all empty gets b = 0."""
    s, ids, G = _scores_1d(scores, group_index)
    L = lengths.to(s.dtype)
    count = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, ids, torch.ones_like(s))
    num = torch.zeros_like(count).index_add_(0, ids, L * s)
    den = torch.zeros_like(count).index_add_(0, ids, L)
    b = torch.where((count > 1) & (den > 0), num / den.clamp(min=1e-12), torch.zeros_like(num))
    return s - b[ids]


@ADVANTAGES.register("opo")
def opo_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: `opo_advantages` on s_i with |o_i| = the row's response tokens (`AdvantageInputs.response_lengths`),
    broadcast to every masked token."""
    group_index = _need(inputs, "group_index", "opo")
    adv = broadcast_to_tokens(opo_advantages(_scores(inputs), inputs.response_lengths, group_index), inputs.mask)
    return adv, adv


def gpg_advantages(scores: torch.Tensor, group_index, alpha_correction: bool = True, norm_by_std: bool = False,
                   eps: float = 1e-6) -> torch.Tensor:
    """GPG group advantage (arXiv 2504.02546, "accurate gradient estimation"), [N]:
    A_i = alpha * (s_i - mean_g) / F_norm.

    alpha = B / B_valid = B / (B - M): B = samples in the batch passed in (the whole step),
    M = samples of groups whose scores are all equal (their advantage is 0, so they add nothing
    to the gradient but count in the loss denominator; alpha rescales to the valid samples), as
    in the paper; alpha = 1 when every group is invalid or with alpha_correction=False. (Checked:
    the authors' code divides the loss by max(1 - M/B, 0.05), the same alpha capped at 20; verl's
    port uses B / #(s_i != 0), which is not the paper's count.) F_norm = 1 (paper default) or the group's
    unbiased std + eps with norm_by_std (the paper's alternative, GRPO's normaliser). A group of
    size 1 has mean 0 and std 1 (as GRPO) and counts as invalid."""
    s, ids, G = _scores_1d(scores, group_index)
    count, mean, std = _group_stats(s, ids, G)
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))
    adv = s - mean
    if norm_by_std:
        adv = adv / (std + eps)
    if alpha_correction:
        smax = torch.full((G,), float("-inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, "amax")
        smin = torch.full((G,), float("inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, "amin")
        invalid = (smax == smin)[ids]
        B, M = s.numel(), int(invalid.sum())
        if M < B:
            adv = adv * (B / (B - M))
    return adv


@ADVANTAGES.register("gpg")
def gpg_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: `gpg_advantages` on s_i (params.gpg_alpha, params.gpg_norm_by_std, params.eps), broadcast."""
    group_index = _need(inputs, "group_index", "gpg")
    per_seq = gpg_advantages(_scores(inputs), group_index, params.gpg_alpha, params.gpg_norm_by_std, params.eps)
    adv = broadcast_to_tokens(per_seq, inputs.mask)
    return adv, adv
