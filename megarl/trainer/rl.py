"""The per-step mathematics wired to megatron: prepare, advantages, critic and actor updates.

The formulas live in megarl.algorithms; this module reads and writes the fields of the step's
`StepBatch`, hands packed micro-batches to those functions, and supplies the global (all
micro-batches, all DP ranks) denominators and statistics that make token-mean and whitening
exact under gradient accumulation (docs/algorithms.md §1.2). Every tensor a collective sees lives on
the training device.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl import algorithms as A
from megarl.data.packing import balance_across_dp
from megarl.parallel import exchange
from megarl.parallel.distributed import device
from megarl.registry import is_dotted_path
from megarl.trainer import pag
from megarl.trainer.batch import MicroBatch, StepBatch

CRITIC_ADVANTAGES = ("gae", "egae")


def uses_critic_advantage(cfg: MegaRLConfig) -> bool:
    """gae/egae, or a custom (dotted-path) estimator in a run with a critic."""
    name = cfg.algorithm.advantage
    return name in CRITIC_ADVANTAGES or (is_dotted_path(name) and cfg.critic.enable)


def plan_minibatches(lengths: list[int], mini_batch_size: int, seed: int, dp_size: int,
                     home: list[int] | None = None) -> list[list[list[int]]]:
    """[mini-batch][DP rank] -> rows (indices into `lengths`, the step's rows in global order):
    the rows shuffled (seeded, same on all ranks), cut into mini-batches of `mini_batch_size`
    samples, each split over the DP ranks with balanced token totals. `home`: the DP rank where
    each row already is; the shuffled rows of each home are then dealt in turn, so every
    mini-batch is a random draw stratified over the homes (which hold random shares of the
    step's prompts), and rows stay home where the balance allows (`balance_across_dp`). A last
    mini-batch with fewer samples than DP ranks (T-PPO batches vary in size) joins the one before
    it. Every rank computes the same plan from the rows' lengths alone (megarl.trainer.rows)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    if home is not None:  # deal the shuffled rows from each DP rank in turn: every mini-batch draws evenly from all
        queues: dict[int, list[int]] = {}
        for i in order:
            queues.setdefault(home[i], []).append(i)
        order = [q[k] for k in range(max(map(len, queues.values()), default=0)) for _, q in sorted(queues.items())
                 if k < len(q)]
    chunks = [order[s : s + mini_batch_size] for s in range(0, len(order), mini_batch_size)]
    if len(chunks) > 1 and len(chunks[-1]) < dp_size:
        tail = chunks.pop()
        chunks[-1] += tail
    out = []
    for mb in chunks:
        shares = balance_across_dp([lengths[i] for i in mb], dp_size, None if home is None else [home[i] for i in mb])
        out.append([[mb[i] for i in share] for share in shares])
    return out


def split_minibatches(lengths: list[int], mini_batch_size: int, seed: int, dp_rank: int,
                      dp_size: int) -> list[list[int]]:
    """This DP rank's share of each mini-batch of `plan_minibatches`."""
    return [mb[dp_rank] for mb in plan_minibatches(lengths, mini_batch_size, seed, dp_size)]


def dp_of_rows(plan: list[list[list[int]]], n: int) -> list[int]:
    """The DP rank that trains each of the n rows of a `plan_minibatches` plan."""
    owner = [-1] * n
    for mb in plan:
        for dp, rows in enumerate(mb):
            for i in rows:
                owner[i] = dp
    return owner


def value_pretraining(cfg: MegaRLConfig, step: int, pretrain_end: int | None = None) -> bool:
    """VC-PPO / VAPO value pretraining: steps train only the critic, on Monte-Carlo targets, until
    `pretrain_end` (TrainerState.value_pretrain_end: the step at which the explained-variance target
    was met) or at most algorithm.value_pretrain_steps steps."""
    return pretrain_end is None and step < cfg.algorithm.value_pretrain_steps


def value_pretraining_converged(cfg: MegaRLConfig, explained_variance: float) -> bool:
    """algorithm.value_pretrain_ev_target reached by this step's explained variance (the critic's
    values before its update, on the step's fresh rollouts: a held-out measure). Rank 0 decides and
    broadcasts, so every rank leaves pretraining at the same step."""
    target = cfg.algorithm.value_pretrain_ev_target
    if target is None:
        return False
    done = torch.tensor([1.0 if explained_variance >= target else 0.0], device=device())
    if dist.is_initialized():
        dist.broadcast(done, src=0)
    return bool(done.item() > 0)


def local_minibatches(minibatches: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """(rows of this rank in mini-batch order, each mini-batch as row indices of that local batch)."""
    rows, local, off = [], [], 0
    for mb in minibatches:
        rows += mb
        local.append(list(range(off, off + len(mb))))
        off += len(mb)
    return rows, local


def set_masks(batch: StepBatch, cfg: MegaRLConfig) -> None:
    """loss_mask: response tokens that count for the policy: the current T-PPO window's (all of
    them without windows, or with algorithm.retrain_earlier_windows), minus samples cut by the
    length cap under the DAPO overlong filter; value_mask: tokens that train the critic (T-PPO /
    EGAE: finished samples only). megarl.algorithms.tppo.tppo_masks."""
    al = cfg.algorithm
    cut = torch.tensor([al.overlong_filter and f == "length" for f in batch.finish_reason])
    unfinished = batch.truncated & (al.advantage == "egae")
    window_start = batch.window_start if batch.window_start is not None else torch.zeros(len(batch), dtype=torch.long)
    policy, batch.value_mask = A.tppo_masks(batch.response_mask, window_start, unfinished, al.retrain_earlier_windows)
    batch.loss_mask = policy * (~cut).float().unsqueeze(1)
    if batch.template_mask is not None:  # PAG: instruction tokens were appended, not generated
        batch.loss_mask = batch.loss_mask * (1.0 - batch.template_mask)
        batch.value_mask = batch.value_mask * (1.0 - batch.template_mask)


# ---- prepare ----------------------------------------------------------------------------------
def compute_log_probs(model, batch: StepBatch, temperature: float) -> torch.Tensor:
    """[B, T] log-probs of the response tokens under `model` (logits / temperature)."""
    return model.forward_only(
        batch, lambda mb, logits: mb.log_probs(logits, temperature))


def compute_values(critic, batch: StepBatch) -> torch.Tensor:
    return critic.forward_only(batch, lambda mb, values: mb.values(values))


# ---- advantages -------------------------------------------------------------------------------
def kl_controller(cfg: MegaRLConfig):
    """The KL coefficient: fixed, or adaptive (`algorithm.kl_target`) for KL-in-reward."""
    al = cfg.algorithm
    if al.kl_target is not None:
        return A.AdaptiveKLController(al.kl_coef, al.kl_target, al.kl_horizon)
    return A.FixedKLController(al.kl_coef)


def _params(cfg: MegaRLConfig, value_pretraining: bool) -> A.AdvantageParams:
    al = cfg.algorithm
    p = A.AdvantageParams(gamma=al.gamma, lam=al.lam_actor, lam_critic=al.lam_critic,
                          length_adaptive_alpha=al.length_adaptive_alpha, whiten=False,
                          norm_by_std=al.norm_adv_by_std, gpg_alpha=al.gpg_alpha,
                          gpg_norm_by_std=al.gpg_norm_by_std)
    if value_pretraining:  # VC-PPO: critic targets are Monte-Carlo returns (lambda = 1, gamma as set)
        p.lam, p.lam_critic, p.length_adaptive_alpha = 1.0, 1.0, None
    return p


def _dp_all_reduce(t: torch.Tensor, dp_group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over data parallelism (the identity in a process without torch.distributed)."""
    if not dist.is_initialized():
        return t
    t = t.to(device())
    dist.all_reduce(t, op=op, group=dp_group)
    exchange.count("scalars", t.numel() * t.element_size())
    return t.cpu()


def per_sample(local: torch.Tensor, rows: list[int], n: int, dp_group) -> torch.Tensor:
    """[len(rows)] values of the rows this DP rank holds -> [n] values of every row of the step
    (each row is held by exactly one DP rank, so a sum over DP assembles the vector)."""
    full = torch.zeros(n, dtype=local.dtype)
    full[torch.tensor(rows, dtype=torch.long)] = local
    return _dp_all_reduce(full, dp_group)


def kl_in_reward(cfg: MegaRLConfig) -> bool:
    return cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0


def token_rewards(batch: StepBatch, cfg: MegaRLConfig, kl_coef: float, dp_group) -> tuple[torch.Tensor, dict[str, float]]:
    """Outcome score on the last response token; with KL-in-reward minus beta * KL per token, and
    the batch's mean per-sample KL (verl's statistic, over all DP ranks) as `actor/reward_kl`.
    Code PRM (prm.dense_reward): plus batch.prm_rewards, the dense line rewards (megarl.trainer.prm),
    their per-sample sum averaged over all DP ranks as `reward/prm_dense`."""
    rewards = (pag.batch_turn_rewards(batch, cfg) if batch.turn_ends is not None  # PAG: one reward per turn
               else A.place_outcome_reward(batch.score, batch.response_mask))
    prm_metrics = {}
    if batch.prm_rewards is not None:
        rewards = rewards + batch.prm_rewards
        s = _dp_all_reduce(torch.stack([batch.prm_rewards.sum().double(), torch.tensor(float(len(batch))).double()]),
                           dp_group)
        prm_metrics["reward/prm_dense"] = float(s[0] / s[1].clamp(min=1.0))
    if not kl_in_reward(cfg):
        return rewards, prm_metrics
    rewards, current_kl = A.apply_kl_in_reward(rewards, batch.old_logprobs, batch.ref_logprobs,
                                               generated_mask(batch), kl_coef, cfg.algorithm.kl_type)
    rows = (batch.response_mask.sum(-1) > 0).sum().double()
    s = _dp_all_reduce(torch.stack([current_kl.double() * rows, rows]), dp_group)
    return rewards, {"actor/reward_kl": float(s[0] / s[1].clamp(min=1.0)), "actor/kl_coef": kl_coef, **prm_metrics}


# critic-free estimators computed per token on the local rows (whitened with DP-reduced moments);
# every other critic-free one is a function of per-sample scores (`compute_advantages`)
TOKEN_LEVEL = ("reinforce_pp", "reinforce_pp_baseline")


def compute_advantages(rows, local: StepBatch, local_rows: list[int], cfg: MegaRLConfig, dp_group,
                       kl_coef: float, value_pretraining: bool = False) -> dict[str, float]:
    """Sets local.advantages (and local.returns for critic estimators); returns metrics.

    `rows`: the step's rows as per-sample vectors, the same on every rank (megarl.trainer.rows.RowTable,
    or a StepBatch of all of them); `local` its rows `local_rows` with this DP rank's log-probs and
    values. Nothing of another rank's rows but per-sample scalars is used:

    - critic estimators run per sequence on the local rows, whitened (when asked) over the
      policy-loss tokens of the whole batch (DP-reduced moments);
    - REINFORCE++ likewise (its discounted returns, whitened over the response tokens of the
      whole batch); REINFORCE++-baseline whitens the group-centred score s_i - mean_g (Dr. GRPO's
      advantage) broadcast to the local tokens, with DP-reduced moments;
    - every other critic-free estimator (GRPO, RLOO, ReMax, OPO, GPG, a dotted-path one) sees the
      whole batch with one token per sample: token_rewards [N, 1] = s_i, mask [N, 1] (1 where the
      response has tokens), `lengths` [N] response tokens, group_index and baseline_scores [N],
      and returns [N, 1]; its value is broadcast over the sample's response tokens. s_i is the
      score (0 for an empty response), or with a KL term in the reward sum_t r_t over the
      sample's tokens, summed on the rank that holds it and DP-reduced.
    """
    al = cfg.algorithm
    estimator = A.ADVANTAGES.resolve(al.advantage, "algorithm.advantage")
    rewards, metrics = token_rewards(local, cfg, kl_coef, dp_group)
    params = _params(cfg, value_pretraining)
    if not uses_critic_advantage(cfg):
        local.advantages = _weighted(_critic_free(estimator, rows, local, local_rows, rewards, cfg, params, dp_group),
                                     local)
        local.returns = local.advantages
        return metrics
    if local.turn_ends is not None:  # PAG: GAE over generated tokens, per turn; RoleAdvNorm
        gae_mask, turn_starts, role_ids = pag.advantage_layout(local, cfg)
        inputs = A.AdvantageInputs(token_rewards=rewards, mask=gae_mask, values=local.values, turn_starts=turn_starts)
        adv, returns = estimator(inputs, params)
        if al.whiten_advantages:
            adv = pag.whiten(adv, local.loss_mask, role_ids, cfg, lambda m: _dp_all_reduce(m, dp_group))
        local.advantages = _weighted(adv * gae_mask, local)
        local.returns = returns * gae_mask
        return metrics
    gae_mask = generated_mask(local)  # tool observations: skipped, values and advantages pass through (ReTool)
    inputs = A.AdvantageInputs(token_rewards=rewards, mask=gae_mask, values=local.values,
                               truncated=local.truncated)
    adv, returns = estimator(inputs, params)
    if al.whiten_advantages:
        adv = _dp_whiten(adv, local.loss_mask, dp_group, keep_masked_out=True)
    local.advantages = _weighted(adv * gae_mask, local)
    local.returns = returns * gae_mask
    return metrics


def _critic_free(estimator, rows, local: StepBatch, local_rows: list[int], rewards: torch.Tensor, cfg: MegaRLConfig,
                 params: A.AdvantageParams, dp_group) -> torch.Tensor:
    """[n_local, T] advantages of a critic-free estimator (`compute_advantages`)."""
    here = torch.tensor(local_rows, dtype=torch.long)
    lengths = rows.response_lengths
    if kl_in_reward(cfg):
        s = per_sample((rewards * local.response_mask).sum(-1), local_rows, len(lengths), dp_group)
    else:
        s = torch.where(lengths > 0, rows.score, torch.zeros_like(rows.score))
    if cfg.algorithm.advantage == "reinforce_pp":
        r = rewards if kl_in_reward(cfg) else A.place_outcome_reward(local.score, local.response_mask)
        returns = A.discounted_returns(r, local.response_mask, params.gamma)
        return _dp_whiten(returns, local.response_mask, dp_group)
    if cfg.algorithm.advantage == "reinforce_pp_baseline":  # s_i - mean_g (0 for a group of one), then whitened
        centred = A.grpo_advantages(s, rows.uid, norm_by_std=False)[here]
        return _dp_whiten(A.broadcast_to_tokens(centred.to(local.response_mask.dtype), local.response_mask),
                          local.response_mask, dp_group)
    inputs = A.AdvantageInputs(token_rewards=s.unsqueeze(1), mask=(lengths > 0).to(s.dtype).unsqueeze(1),
                               group_index=rows.uid, baseline_scores=rows.baseline_score, lengths=lengths)
    adv, _ = estimator(inputs, params)
    if adv.shape != (len(lengths), 1):
        raise ValueError(f"advantage estimator {cfg.algorithm.advantage!r} returned shape {tuple(adv.shape)}; a "
                         f"critic-free estimator gets one token per sample and returns [{len(lengths)}, 1]")
    return A.broadcast_to_tokens(adv[here, 0].to(local.response_mask.dtype), local.response_mask)


def _dp_whiten(x: torch.Tensor, mask: torch.Tensor, dp_group, keep_masked_out: bool = False) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the mean and unbiased variance of x over the masked
    tokens of every DP rank; 0 at masked-out positions unless keep_masked_out."""
    mean, var = A.stats_from_moments(_dp_all_reduce(A.masked_moments(x, mask).double(), dp_group))
    if keep_masked_out:
        return (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + 1e-8)
    return A.masked_whiten(x, mask, stats=(mean.to(x.dtype), var.to(x.dtype)))


def generated_mask(batch: StepBatch) -> torch.Tensor:
    """[B, T] 1.0 on the response tokens the policy sampled: all of them, minus the tokens the
    environment appended (template_mask: PAG instructions, tool observations)."""
    return batch.response_mask if batch.template_mask is None else batch.response_mask * (1.0 - batch.template_mask)


def _weighted(advantages: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Advantages times the rollout IS weights, when set: for the weightable policy losses this is
    the weighted policy-gradient term (megarl.algorithms.offpolicy); critic targets are unweighted."""
    return advantages if batch.is_weights is None else advantages * batch.is_weights


def rollout_correction(batch: StepBatch, cfg: MegaRLConfig, dp_group) -> dict[str, float]:
    """algorithm.rollout_is (megarl.algorithms.offpolicy): sets batch.is_weights from the trainer's
    old log-probs and the engine's, over the policy-loss tokens; MIS also takes the tokens above
    the threshold out of batch.loss_mask. Metrics over every DP rank's tokens."""
    mode = cfg.algorithm.rollout_is
    if mode is None:
        return {}
    batch.is_weights, batch.loss_mask, stats = A.rollout_is_weights(
        batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, mode, cfg.algorithm.rollout_is_cap)
    sums = _dp_all_reduce(stats[:4], dp_group)
    peak = _dp_all_reduce(stats[4:], dp_group, dist.ReduceOp.MAX)
    return A.rollout_is_metrics(torch.cat([sums, peak]), mode)


def explained_variance(batch: StepBatch, dp_group) -> dict[str, float]:
    """EV = 1 - Var(ret - V)/Var(ret) over the value tokens of the whole batch (DP-reduced moments);
    0 when the returns do not vary (every sample scored the same: the moments then leave a rounding
    residue of ~1e-16 for Var(ret), which would give EVs of -1e12)."""
    m = torch.stack([A.masked_moments(batch.returns, batch.value_mask),
                     A.masked_moments(batch.returns - batch.values, batch.value_mask)]).double()
    m = _dp_all_reduce(m, dp_group)
    (_, var_r), (_, var_d) = A.stats_from_moments(m[0]), A.stats_from_moments(m[1])
    return {"critic/explained_variance": float(1.0 - var_d / var_r) if var_r > 1e-8 else 0.0}


def logprob_mismatch(batch: StepBatch, dp_group) -> dict[str, float]:
    """Mean and max |rollout log-prob - trainer log-prob| over the tokens the engine generated
    with the weights the trainer holds (the latest T-PPO window; every response token without
    windows): the engine/trainer numerical mismatch (diagnostic, docs/algorithms.md §0). Earlier
    windows' tokens came from older weights; `rollout_correction` weighs those."""
    mask = batch.window_mask
    if batch.template_mask is not None:  # PAG instruction tokens have no engine log-prob
        mask = mask * (1.0 - batch.template_mask)
    d = (batch.rollout_logprobs - batch.old_logprobs).abs() * mask
    s = _dp_all_reduce(torch.stack([d.sum(), mask.sum()]).double(), dp_group)
    peak = _dp_all_reduce(d.max().reshape(1).double() if d.numel() else torch.zeros(1, dtype=torch.float64),
                          dp_group, dist.ReduceOp.MAX)
    return {"rollout/logprob_mismatch": float(s[0] / s[1].clamp(min=1.0)),
            "rollout/logprob_mismatch_max": float(peak[0])}


# ---- updates ----------------------------------------------------------------------------------
def global_counts(batch: StepBatch, rows: list[int], dp_group, mask: torch.Tensor) -> dict[str, float]:
    """Token / sequence counts of a mini-batch over all DP ranks (the loss denominators), and
    those of its positive (acc) samples for VAPO's NLL term; `empty`: no token counts at all."""
    m = mask[torch.tensor(rows, dtype=torch.long)] if rows else mask[:0]
    pos = batch.acc[torch.tensor(rows, dtype=torch.long)].float() if rows else torch.zeros(0)
    tok = m.sum(-1)
    local = torch.stack([tok.sum(), (tok > 0).float().sum(), (tok * pos).sum(), ((tok > 0).float() * pos).sum()])
    tok, seq, pos_tok, pos_seq = _dp_all_reduce(local.double(), dp_group).tolist()
    return {"tokens": max(tok, 1.0), "seqs": max(seq, 1.0), "pos_tokens": max(pos_tok, 1.0),
            "pos_seqs": max(pos_seq, 1.0), "empty": tok == 0}


def _share(metrics: dict[str, torch.Tensor], n_local: float, n_global: float, prefix: str) -> dict[str, torch.Tensor]:
    """Local means -> their share of the global mean (summing shares over micro-batches and
    DP ranks gives the mini-batch mean). Max/min statistics do not sum and are left out."""
    w = n_local / n_global
    return {f"{prefix}/{k}": v.detach() * w for k, v in metrics.items()
            if k not in ("ratio_max", "ratio_min", "n_tokens")}


def objective_kwargs(cfg: MegaRLConfig) -> dict:
    """The keyword parameters of the selected policy loss from their algorithm.* fields
    (megarl.algorithms.objectives.CONFIG_KWARGS; none for ppo / vanilla_pg)."""
    fields = A.objectives.CONFIG_KWARGS.get(cfg.algorithm.policy_loss, {})
    return {kw: getattr(cfg.algorithm, name) for kw, name in fields.items()}


def actor_loss_fn(cfg: MegaRLConfig, counts: dict[str, float], temperature: float):
    al = cfg.algorithm
    policy_loss = A.POLICY_LOSSES[al.policy_loss]
    objective = objective_kwargs(cfg)
    denominators = dict(global_tokens=counts["tokens"], global_seqs=counts["seqs"], max_len=cfg.rollout.max_new_tokens)

    def loss_fn(mb: MicroBatch, logits):
        d = mb.data
        logp = mb.log_probs(logits, temperature)
        mask = d.loss_mask
        loss, m = policy_loss(logp, d.old_logprobs, d.advantages, mask, al.clip_low, al.clip_high, al.clip_c,
                              agg=al.loss_agg, **denominators, **objective)
        logs = _share(m, float(mask.sum()), counts["tokens"], "actor")
        logs["actor/pg_loss"] = loss.detach()
        if al.kl_coef > 0 and not al.kl_in_reward:
            kl_loss = A.agg_loss(A.kl_penalty(logp, d.ref_logprobs, al.kl_type), mask, al.loss_agg, **denominators)
            loss = loss + al.kl_coef * kl_loss
            logs["actor/kl_loss"] = kl_loss.detach()
        with torch.set_grad_enabled(al.entropy_coef > 0 and torch.is_grad_enabled()):
            ent = mb.entropy(logits, temperature)
            ent_agg = A.agg_loss(ent, mask, al.loss_agg, **denominators)
        if al.entropy_coef > 0:
            loss = loss - al.entropy_coef * ent_agg
        logs["actor/entropy"] = ent_agg.detach()
        if al.pos_lm_coef > 0:
            nll = A.positive_example_nll(logp, mask, d.acc, "token-mean", counts["pos_tokens"])
            loss = loss + al.pos_lm_coef * nll
            logs["actor/pos_lm_loss"] = nll.detach()
        return loss, logs

    return loss_fn


def critic_loss_fn(cfg: MegaRLConfig, counts: dict[str, float]):
    al = cfg.algorithm

    def loss_fn(mb: MicroBatch, values):
        d = mb.data
        v = mb.values(values)
        loss, m = A.value_loss(v, d.values, d.returns, d.value_mask, al.value_clip, "token-mean", counts["tokens"])
        logs = _share(m, float(d.value_mask.sum()), counts["tokens"], "critic")
        logs["critic/value_loss"] = loss.detach()
        return loss, logs

    return loss_fn


def update(model, batch: StepBatch, minibatches: list[list[int]], loss_factory, dp_group,
           mask: torch.Tensor) -> dict[str, float]:
    """One optimizer step per mini-batch (rows of `batch`); metrics averaged over mini-batches.
    `mask` ([B, T] of `batch`) gives the loss denominators: loss_mask or value_mask. A mini-batch
    with no such token on any DP rank is skipped (T-PPO: the critic when no sample in it finished;
    an optimizer step on zero gradients would still move Adam's momentum and weight decay)."""
    counts = [global_counts(batch, rows, dp_group, mask) for rows in minibatches]
    todo = [(rows, c) for rows, c in zip(minibatches, counts) if not c["empty"]]
    totals: dict[str, float] = {}
    role = "critic" if model.value_head else "actor"
    for rows, c in todo:
        metrics = model.train_step(batch, loss_factory(c), rows)
        metrics[f"{role}/grad_norm"] = metrics.pop("grad_norm")  # actor and critic both report one
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / len(todo)
    return totals
