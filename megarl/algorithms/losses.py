"""Loss aggregation (docs/algorithms.md §1.2), PPO policy loss (§1.1), value loss (§1.4), VAPO's
positive-example NLL (§4), entropy.

Shapes: [B, T] per-token tensors, `mask` [B, T] (1 = token counts).

Gradient accumulation / data parallel (§1.2 pitfall): pass the counts of the WHOLE optimizer
mini-batch (all micro-batches, all DP/CP ranks) as `global_tokens` / `global_seqs`; then every
aggregated loss is a sum of per-micro-batch terms, and the caller must SUM (not average) the
micro-batch losses. If the DP all-reduce averages gradients, multiply the loss by dp_size.
Without global counts the local counts are used (exact only for a single micro-batch).

Metrics are detached 0-dim tensors over the local masked tokens (no host sync); `n_tokens` is
included so the caller can weight them when reducing.
"""

from __future__ import annotations

import torch

from .registry import LOSS_AGGS, POLICY_LOSSES

Count = int | float | torch.Tensor | None

LOG_RATIO_CLAMP = 20.0


def _msum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """sum(x * m) as one dot product (no [B, T] temporary); differentiable."""
    return torch.dot(x.reshape(-1), m.reshape(-1))


def _check_count(name: str, c: Count) -> None:
    if isinstance(c, (int, float)) and c <= 0:
        raise ValueError(f"{name} must be > 0, got {c}")


@LOSS_AGGS.register("token-mean")
def _token_mean(loss_mat, m, global_tokens=None, global_seqs=None, max_len=None):
    """sum_{i,t} m*l / N_tok, N_tok = global_tokens or local sum(m) (0 tokens -> loss 0)."""
    _check_count("global_tokens", global_tokens)
    den = m.sum().clamp(min=1.0) if global_tokens is None else global_tokens
    return _msum(loss_mat, m) / den


def _local_seqs(m):
    return (m.sum(-1) > 0).to(m.dtype).sum().clamp(min=1.0)


@LOSS_AGGS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, m, global_tokens=None, global_seqs=None, max_len=None):
    """sum_i (sum_t m*l / sum_t m) / N_seq; N_seq = global_seqs or the local number of rows with >= 1 token."""
    _check_count("global_seqs", global_seqs)
    per_seq = (loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    den = _local_seqs(m) if global_seqs is None else global_seqs
    return per_seq.sum() / den


@LOSS_AGGS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, m, global_tokens=None, global_seqs=None, max_len=None):
    """sum_i sum_t m*l / N_seq; N_seq = global_seqs or the local number of rows with >= 1 token."""
    _check_count("global_seqs", global_seqs)
    den = _local_seqs(m) if global_seqs is None else global_seqs
    return _msum(loss_mat, m) / den


@LOSS_AGGS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, m, global_tokens=None, global_seqs=None, max_len=None):
    """Dr. GRPO: (1/N_seq) sum_i sum_t m*l / L = sum_{i,t} m*l / (N_seq * L).

    N_seq = global_seqs (sequences with >= 1 token in the whole mini-batch) or the local number
    of such rows; L = max_len (the configured max response length, a constant) or T. The Dr. GRPO
    objective averages the per-response token sums over the G responses and divides by the
    generation budget instead of each response's length, so no length bias enters the gradient;
    without 1/N_seq the loss would grow linearly with the number of sequences. With both counts
    global the terms add up over micro-batches and DP ranks to the same value for any split."""
    _check_count("global_seqs", global_seqs)
    L = loss_mat.shape[-1] if max_len is None else max_len
    _check_count("max_len", L)
    den = _local_seqs(m) if global_seqs is None else global_seqs
    return _msum(loss_mat, m) / (den * L)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] to a scalar (docs/algorithms.md §1.2). Modes and denominators:

    - token-mean:              sum(m*l) / global_tokens (default: local sum(m))
    - seq-mean-token-mean:     sum_i(sum_t m*l / sum_t m) / global_seqs (default: local non-empty rows)
    - seq-mean-token-sum:      sum(m*l) / global_seqs
    - seq-mean-token-sum-norm: sum(m*l) / (global_seqs * max_len) (Dr. GRPO; default max_len = T;
      pass the configured max response length under micro-batching)

    mask is 0/1 (bool or numeric). Half-precision losses are reduced in float32.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss shape {tuple(loss_mat.shape)} does not match mask {tuple(mask.shape)}")
    if loss_mat.dtype in (torch.float16, torch.bfloat16):
        loss_mat = loss_mat.float()  # reduce in float32
    m = mask.to(loss_mat.dtype)
    return LOSS_AGGS[mode](loss_mat, m, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)


def _count(cond: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """Number of masked-in tokens where cond holds (cond is a fresh bool tensor, modified in place)."""
    return cond.logical_and_(mb).sum()


def _masked_minmax(x: torch.Tensor, mb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of x over masked-in tokens in one pass: masked-out entries are replaced by one
    masked-in value, which changes neither. Meaningless (but finite) when no token is masked in."""
    first = mb.reshape(-1).view(torch.uint8).argmax()
    filled = torch.where(mb, x, x.reshape(-1)[first])
    return torch.aminmax(filled)


def _ratio_metrics(ratio, log_ratio, mb, m, count, n) -> dict[str, torch.Tensor]:
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    has = count > 0
    s_ratio, s_log = _msum(ratio, m), _msum(log_ratio, m)
    lo, hi = _masked_minmax(log_ratio, mb)
    return {
        # KL(pi_old || pi_theta) estimated on samples from pi_old, x = logp - logp_old:
        "approx_kl": (s_ratio - s_log - count) / n,  # k3: mean(e^x - 1 - x) (>= 0, low variance)
        "approx_kl_k1": -s_log / n,  # k1: mean(-x)
        "ratio_mean": s_ratio / n,
        "ratio_max": torch.where(has, hi.exp(), one),
        "ratio_min": torch.where(has, lo.exp(), one),
    }


def _check_shapes(name: str, *ts: torch.Tensor) -> None:
    if len({tuple(t.shape) for t in ts}) != 1:
        raise ValueError(f"{name}: log_probs, old_log_probs, advantages and mask must have the same shape, got "
                         + ", ".join(str(tuple(t.shape)) for t in ts))


def _base_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, dtype) -> tuple:
    """(metrics with the ratio statistics and n_tokens, mask as bool, token count, clamped count as
    float): what every policy loss reports besides its own clip fractions."""
    mb = mask.bool()
    count = mb.sum()
    n = count.clamp(min=1).to(dtype)
    metrics = _ratio_metrics(ratio.detach(), log_ratio.detach(), mb, mask.to(dtype), count, n)
    metrics["n_tokens"] = count.to(dtype)
    return metrics, mb, count, n


def _log_ratio_and_ratio(log_probs, old_log_probs):
    log_ratio = (log_probs - old_log_probs).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


@POLICY_LOSSES.register("ppo")
def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    global_tokens: Count = None,
    *,
    global_seqs: Count = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and optional dual-clip (docs/algorithms.md §1.1). -> (loss, metrics).

    rho = exp(clamp(logp - logp_old, -20, 20));  L1 = -A*rho;  L2 = -A*clip(rho, 1-clip_low, 1+clip_high);
    l = max(L1, L2); with dual-clip c > 1 and A < 0: l = min(l, -A*c). loss = agg_loss(l, mask, agg, ...)
    (denominators in `agg_loss`). Clip-higher (DAPO) is clip_high > clip_low.

    Metrics (detached, local masked tokens, denominator n_tokens = sum(m), 0 when empty):
    clipfrac_high = frac(A > 0 and rho > 1+clip_high), clipfrac_low = frac(A < 0 and rho < 1-clip_low)
    (tokens where the clip is active, i.e. L2 > L1), clipfrac = their sum, dual_clip_frac =
    frac(A < 0 and max(L1, L2) > -A*c), approx_kl = k3 estimate of KL(pi_old||pi_theta) = mean(rho-1-log rho),
    approx_kl_k1 = mean(-log rho), ratio_mean/max/min (1.0 when empty), n_tokens.
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"policy_loss: dual-clip constant clip_c must be > 1, got {clip_c}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"policy_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    _check_shapes("policy_loss", log_probs, old_log_probs, advantages, mask)
    neg_adv = -advantages.to(log_probs.dtype)
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    clipped = torch.maximum(neg_adv * ratio, neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if clip_c is not None:
        per_token = torch.where(neg_adv > 0, torch.minimum(clipped, neg_adv * clip_c), clipped)
    else:
        per_token = clipped
    loss = agg_loss(per_token, mask, agg, global_tokens, global_seqs, max_len)

    with torch.no_grad():
        # Where the clip is active (L2 > L1): A > 0 and rho > 1+clip_high, or A < 0 and rho < 1-clip_low.
        # Dual-clip is active where A < 0 and max(rho, clip(rho)) > c, i.e. rho > c (c > 1).
        base, mb, _, n = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
        ratio = ratio.detach()
        pos, neg = (neg_adv < 0).logical_and_(mb), (neg_adv > 0).logical_and_(mb)  # A > 0, A < 0 (masked-in)
        high = _count(ratio > 1.0 + clip_high, pos) / n
        low = _count(ratio < 1.0 - clip_low, neg) / n
        metrics = {"clipfrac_high": high, "clipfrac_low": low, "clipfrac": high + low}
        metrics["dual_clip_frac"] = _count(ratio > clip_c, neg) / n if clip_c is not None else torch.zeros_like(high)
        metrics.update(base)
    return loss, metrics


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    global_tokens: Count = None,
    *,
    global_seqs: Count = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unclipped importance-weighted policy gradient: l = -A * rho (rho as in `policy_loss`).

    At rho = 1 its gradient is REINFORCE's -A * grad log pi. Clip arguments are accepted for a
    uniform signature and ignored. Metrics: approx_kl (k3), approx_kl_k1, ratio_mean/max/min, n_tokens.
    """
    _check_shapes("vanilla_pg", log_probs, old_log_probs, advantages, mask)
    log_ratio, ratio = _log_ratio_and_ratio(log_probs, old_log_probs)
    loss = agg_loss(-advantages.to(log_probs.dtype) * ratio, mask, agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        metrics, *_ = _base_metrics(log_ratio, ratio, mask, log_probs.dtype)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = None,
    agg: str = "token-mean",
    global_tokens: Count = None,
    *,
    global_seqs: Count = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (docs/algorithms.md §1.4). -> (loss, metrics).

    v_clip = clip(v, v_old - eps, v_old + eps); l = 0.5 * max((v - R)^2, (v_clip - R)^2)
    (l = 0.5*(v - R)^2 when clip_eps is None); loss = agg_loss(l, mask, agg, ...).
    Metrics (local masked tokens, denominator sum(m)): vf_clipfrac = frac((v_clip - R)^2 > (v - R)^2),
    vpred_mean, vf_mse = mean((v - R)^2), n_tokens.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("value_loss: values, old_values, returns and mask must have the same shape")
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value_loss: clip_eps must be > 0 or None, got {clip_eps}")
    ret = returns.to(values.dtype)
    err = (values - ret) ** 2
    if clip_eps is not None:
        # clamp v itself (not old + clamp(v - old)): inside the range v_clip is then exactly v, so
        # vf_clipfrac counts only tokens that are really clipped (the round trip can change the last bit)
        v_clip = torch.clamp(values, old_values - clip_eps, old_values + clip_eps)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
    else:
        err_clip = err
        per_token = 0.5 * err
    loss = agg_loss(per_token, mask, agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        mb = mask.bool()
        m = mask.to(values.dtype)
        count = mb.sum()
        n = count.clamp(min=1).to(values.dtype)
        metrics = {
            "vf_clipfrac": _count(err_clip > err, mb) / n,
            "vpred_mean": _msum(values.detach(), m) / n,
            "vf_mse": _msum(err.detach(), m) / n,
            "n_tokens": count.to(values.dtype),
        }
    return loss, metrics


def positive_example_nll(
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    is_positive: torch.Tensor,
    agg: str = "token-mean",
    global_tokens: Count = None,
    *,
    global_seqs: Count = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """VAPO positive-example LM loss (docs/algorithms.md §4): L_NLL = -(1/sum_{o in T}|o|) sum_{o in T} sum_t log pi.

    T = rows with is_positive[b] (correct samples; [NS→C] reward > 0 is the caller's threshold).
    Token mask m' = m * is_positive; loss = agg_loss(-logp, m', agg, ...). For token-mean pass
    global_tokens = the global count of tokens of POSITIVE rows. 0 (with a graph) when no positive
    token exists. The weight mu is applied by the trainer.
    """
    if is_positive.shape != mask.shape[:1]:
        raise ValueError(f"is_positive has shape {tuple(is_positive.shape)}, mask has {tuple(mask.shape)}")
    pos_mask = mask.to(log_probs.dtype) * is_positive.to(log_probs.dtype).unsqueeze(-1)
    return agg_loss(-log_probs, pos_mask, agg, global_tokens, global_seqs, max_len)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last axis: H = logsumexp(z) - sum_v p_v z_v.

    Stable: z is first shifted by its max (H is shift-invariant), so there is neither exp overflow
    nor cancellation between two large numbers; -inf logits (banned tokens) contribute 0.
    Computed in at least float32. No reduction.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    z = z - z.detach().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(z.dtype).min)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    pz = torch.where(p > 0, p * z, torch.zeros_like(p))
    return lse.squeeze(-1) - pz.sum(-1)
