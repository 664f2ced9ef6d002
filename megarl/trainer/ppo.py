"""The per-step mathematics wired to megatron: prepare, advantages, critic and actor updates.

The formulas live in megarl.algorithms; this module only moves tensors between trajectories,
packed micro-batches and those functions, and supplies the global (all micro-batches, all DP
ranks) denominators that make token-mean exact under gradient accumulation (ALGORITHMS §1.2).
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megarl import algorithms as A
from megarl.data.packing import balance_across_dp
from megarl.trainer import vocab_parallel
from megarl.trainer.batch import MicroBatch, Trajectory, response_tensor, scatter_response_tensor

CRITIC_ADVANTAGES = ("gae", "egae")


def split_minibatches(trajs: list[Trajectory], mini_batch_size: int, seed: int,
                      dp_rank: int, dp_size: int) -> list[list[Trajectory]]:
    """Shuffles the step's batch (seeded, same on all ranks), cuts it into mini-batches of
    `mini_batch_size` samples, and returns this DP rank's token-balanced share of each."""
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    out = []
    for s in range(0, len(order), mini_batch_size):
        mb = [trajs[i] for i in order[s : s + mini_batch_size]]
        shares = balance_across_dp([t.length for t in mb], dp_size)
        out.append([mb[i] for i in shares[dp_rank]])
    return out


# ---- prepare ----------------------------------------------------------------------------------
def compute_log_probs(model, trajs: list[Trajectory], key: str, temperature: float) -> None:
    def fn(mb: MicroBatch, logits):
        logp = vocab_parallel.token_log_probs(logits, mb.targets, temperature)
        return {key: mb.gather(logp)}

    model.forward_only(trajs, fn, [key])


def compute_values(critic, trajs: list[Trajectory]) -> None:
    def fn(mb: MicroBatch, values):
        return {"values": mb.gather(values.reshape(-1).float())}

    critic.forward_only(trajs, fn, ["values"])


# ---- advantages -------------------------------------------------------------------------------
def _params(cfg) -> A.AdvantageParams:
    al = cfg.algorithm
    return A.AdvantageParams(gamma=al.gamma, lam=al.lam_actor, lam_critic=al.lam_critic,
                             length_adaptive_alpha=al.length_adaptive_alpha, whiten=False,
                             norm_by_std=al.norm_adv_by_std)


def _token_rewards(trajs: list[Trajectory], cfg) -> tuple[torch.Tensor, torch.Tensor]:
    _, mask = response_tensor(trajs, "")
    scores = torch.tensor([t.score for t in trajs], dtype=torch.float32)
    rewards = A.place_outcome_reward(scores, mask)
    al = cfg.algorithm
    if al.kl_coef > 0 and al.kl_in_reward:
        old, _ = response_tensor(trajs, "old_logprobs")
        ref, _ = response_tensor(trajs, "ref_logprobs")
        rewards = rewards - al.kl_coef * A.kl_penalty(old, ref, al.kl_type) * mask
    return rewards, mask


def compute_advantages(all_trajs: list[Trajectory], local_trajs: list[Trajectory], cfg, dp_group,
                       critic_only_returns: bool = False) -> None:
    """Stores `advantages` (and `returns` for critic estimators) on the trajectories.

    Group estimators (grpo, rloo, reinforce_pp*) see the whole batch on every rank. Critic
    estimators run on this rank's trajectories (GAE is per sequence) and are whitened, when
    asked, with statistics all-reduced over DP, i.e. over the whole batch.
    """
    al = cfg.algorithm
    if al.advantage not in CRITIC_ADVANTAGES:
        rewards, mask = _token_rewards(all_trajs, cfg)
        inputs = A.AdvantageInputs(token_rewards=rewards, mask=mask, group_index=[t.uid for t in all_trajs])
        adv, _ = A.ADVANTAGES[al.advantage](inputs, _params(cfg))
        scatter_response_tensor(all_trajs, "advantages", adv)
        return
    if not local_trajs:
        return
    rewards, mask = _token_rewards(local_trajs, cfg)
    values, _ = response_tensor(local_trajs, "values")
    truncated = torch.tensor([t.finish_reason == "truncated" for t in local_trajs])
    inputs = A.AdvantageInputs(token_rewards=rewards, mask=mask, values=values, truncated=truncated)
    params = _params(cfg)
    if critic_only_returns:  # value pretraining: Monte-Carlo targets (lambda = 1)
        params.lam, params.length_adaptive_alpha = 1.0, None
    adv, returns = A.ADVANTAGES[al.advantage](inputs, params)
    if al.whiten_advantages:
        moments = A.masked_moments(adv, mask).double()
        dist.all_reduce(moments, group=dp_group)
        mean, var = A.stats_from_moments(moments)
        adv = (adv - mean.float()) * torch.rsqrt(var.float() + 1e-8) * mask
    scatter_response_tensor(local_trajs, "advantages", adv)
    scatter_response_tensor(local_trajs, "returns", returns)


# ---- updates ----------------------------------------------------------------------------------
def global_counts(trajs: list[Trajectory], dp_group) -> dict[str, float]:
    """Token / sequence counts of the whole mini-batch (all DP ranks) for the loss denominators."""
    local = torch.tensor([
        sum(float(t.tensors["loss_mask"].sum()) for t in trajs),
        sum(1.0 for t in trajs if float(t.tensors["loss_mask"].sum()) > 0),
        sum(float(t.tensors["loss_mask"].sum()) for t in trajs if t.acc),
        sum(1.0 for t in trajs if t.acc and float(t.tensors["loss_mask"].sum()) > 0),
    ], dtype=torch.float64)
    dist.all_reduce(local, group=dp_group)
    tok, seq, pos_tok, pos_seq = local.tolist()
    return {"tokens": max(tok, 1.0), "seqs": max(seq, 1.0), "pos_tokens": max(pos_tok, 1.0),
            "pos_seqs": max(pos_seq, 1.0)}


def _share(metrics: dict[str, torch.Tensor], n_local: float, n_global: float, prefix: str) -> dict[str, torch.Tensor]:
    """Local means -> their share of the global mean (summing shares over micro-batches and
    DP ranks gives the mini-batch mean). Max/min statistics do not sum and are left out."""
    w = n_local / n_global
    return {f"{prefix}/{k}": v.detach() * w for k, v in metrics.items()
            if k not in ("ratio_max", "ratio_min", "n_tokens")}


def actor_loss_fn(cfg, counts: dict[str, float], temperature: float):
    al = cfg.algorithm
    agg_kw = dict(agg=al.loss_agg, global_tokens=counts["tokens"], global_seqs=counts["seqs"],
                  max_len=cfg.rollout.max_new_tokens)

    def loss_fn(mb: MicroBatch, logits):
        logp_all = vocab_parallel.token_log_probs(logits, mb.targets, temperature)
        logp = mb.gather(logp_all)
        mask = mb.padded("loss_mask")
        old = mb.padded("old_logprobs")
        adv = mb.padded("advantages")
        loss, m = A.policy_loss(logp, old, adv, mask, al.clip_low, al.clip_high, al.clip_c, **agg_kw)
        n_local = float(mask.sum())
        logs = _share(m, n_local, counts["tokens"], "actor")
        logs["actor/pg_loss"] = loss.detach()
        if al.kl_coef > 0 and not al.kl_in_reward:
            kl = A.kl_penalty(logp, mb.padded("ref_logprobs"), al.kl_type)
            kl_loss = A.agg_loss(kl, mask, al.loss_agg, counts["tokens"], counts["seqs"], cfg.rollout.max_new_tokens)
            loss = loss + al.kl_coef * kl_loss
            logs["actor/kl_loss"] = kl_loss.detach()
        with torch.set_grad_enabled(al.entropy_coef > 0 and torch.is_grad_enabled()):
            flat = logits.reshape(-1, logits.shape[-1])[mb.resp_index.reshape(-1)]  # response positions only
            ent = vocab_parallel.entropy(flat, temperature).reshape(mask.shape)
            ent_mean = A.agg_loss(ent, mask, "token-mean", counts["tokens"])
        if al.entropy_coef > 0:
            loss = loss - al.entropy_coef * ent_mean
        logs["actor/entropy"] = ent_mean.detach()
        if al.pos_lm_coef > 0:
            is_pos = torch.tensor([t.acc for t in mb.trajectories])
            nll = A.positive_example_nll(logp, mask, is_pos, "token-mean", counts["pos_tokens"])
            loss = loss + al.pos_lm_coef * nll
            logs["actor/pos_lm_loss"] = nll.detach()
        return loss, logs

    return loss_fn


def critic_loss_fn(cfg, counts: dict[str, float]):
    al = cfg.algorithm

    def loss_fn(mb: MicroBatch, values):
        v = mb.gather(values.reshape(-1).float())
        mask = mb.padded("value_mask")
        loss, m = A.value_loss(v, mb.padded("values"), mb.padded("returns"), mask, al.value_clip,
                               "token-mean", counts["tokens"])
        logs = _share(m, float(mask.sum()), counts["tokens"], "critic")
        logs["critic/value_loss"] = loss.detach()
        return loss, logs

    return loss_fn


def set_masks(trajs: list[Trajectory], cfg) -> None:
    """loss_mask: response tokens that count for the policy (DAPO overlong filter zeroes
    truncated samples); value_mask: tokens that train the critic (T-PPO: finished only)."""
    al = cfg.algorithm
    for t in trajs:
        ones = torch.ones(len(t.response_ids))
        cut = al.overlong_filter and t.finish_reason == "length"
        t.tensors["loss_mask"] = ones * (0.0 if cut else 1.0)
        unfinished = al.advantage == "egae" and t.finish_reason == "truncated"
        t.tensors["value_mask"] = ones * (0.0 if unfinished else 1.0)


def update(model, minibatches: list[list[Trajectory]], loss_factory, dp_group, mask_key: str) -> dict[str, float]:
    """One optimizer step per mini-batch; returns metrics averaged over the mini-batches."""
    totals: dict[str, float] = {}
    for local in minibatches:
        counts = global_counts_for(local, dp_group, mask_key)
        metrics = model.train_step(local, loss_factory(counts))
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / len(minibatches)
    return totals


def global_counts_for(trajs: list[Trajectory], dp_group, mask_key: str) -> dict[str, float]:
    if mask_key == "loss_mask":
        return global_counts(trajs, dp_group)
    tok = torch.tensor([sum(float(t.tensors[mask_key].sum()) for t in trajs)], dtype=torch.float64)
    dist.all_reduce(tok, group=dp_group)
    return {"tokens": max(float(tok), 1.0)}
