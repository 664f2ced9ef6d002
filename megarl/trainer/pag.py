"""PAG in the trainer (docs/algorithms.md §8, algorithm.pag.*): multi-turn rollouts scored per turn,
per-turn rewards, turn-independent GAE inputs, RoleAdvNorm with DP-reduced per-role moments,
and the PAG metrics.

- Rollout: `generate_turns` runs megarl.rollout.multi_turn.pag_rollout on the worker's engine;
  `score` checks every policy turn's answer with the reward manager (its last
  algorithm.pag.answer_tail_chars characters, as the released code's 300) and makes one
  Trajectory per sample: response = all turns incl. instruction tokens, template_mask, turn_ends,
  turn_is_policy, turn_outcome (policy turn: answer correct 1 / 0; verifier turn: verdict 1 / 0 /
  -1 missing). Trajectory.acc = the last policy turn's correctness (final accuracy);
  Trajectory.score = the trajectory's summed PAG turn rewards (a diagnostic; the advantages use
  the per-turn rewards).
- Advantages (`rl.compute_advantages`): token rewards = pag_turn_rewards (R_y, revision bonus
  alpha * (R_y(y_t) - R_y(y_t-1)), R_v, each on the last token of its turn); GAE over the generated
  tokens only (template tokens skipped), reset at every turn start (turn_independent); whitening
  per role (RoleAdvNorm) over the policy-loss tokens of the whole batch.
"""

from __future__ import annotations

from typing import Callable

import torch

from megarl.config import MegaRLConfig
from megarl.algorithms.masked import WHITEN_EPS, masked_moments, stats_from_moments
from megarl.algorithms.pairwise_pag import POLICY_ROLE, VERIFIER_ROLE, pag_turn_layout, pag_turn_rewards
from megarl.rollout.multi_turn import MultiTurnSample, pag_rollout
from megarl.trainer.batch import StepBatch, Trajectory

ROLES = (POLICY_ROLE, VERIFIER_ROLE)


# ---- rollout ----------------------------------------------------------------------------------
def instructions(cfg: MegaRLConfig, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of algorithm.pag.verify_instruction and revise_instruction (no special tokens added)."""
    g = cfg.algorithm.pag
    return tuple(list(tokenizer.encode(text, add_special_tokens=False))
                 for text in (g.verify_instruction, g.revise_instruction))


def generate_turns(worker, prompts: list[list[int]], sampling) -> list[MultiTurnSample]:
    """PAG trajectories for `prompts` on the worker's engine (megarl.rollout.multi_turn)."""
    tok = worker.tokenizer
    verify, revise = instructions(worker.cfg, tok)
    return pag_rollout(worker.engine, prompts, sampling, verify, revise, worker.cfg.algorithm.pag.max_policy_turns,
                       lambda ids: tok.decode(ids, skip_special_tokens=True))


def score(worker, items, samples: list[MultiTurnSample]) -> tuple[list[Trajectory], dict[str, float]]:
    """Checks every policy turn (one reward-manager call) and builds the trajectories (module doc)."""
    from megarl.rewards import RewardInput

    g = worker.cfg.algorithm.pag
    where = [(k, j) for k, s in enumerate(samples) for j, pol in enumerate(s.turn_is_policy) if pol]
    inputs = []
    for k, j in where:
        item = items[samples[k].index]
        inputs.append(RewardInput(data_source=item.data_source, prompt=item.prompt,
                                  response=samples[k].turn_texts[j][-g.answer_tail_chars:], gold=item.answer,
                                  reference=item.reference, extra=item.extra))
    outputs, metrics = worker.rewards.score(inputs) if inputs else ([], {})
    correct = {kj: int(bool(out.acc)) for kj, out in zip(where, outputs)}
    trajs = []
    for k, s in enumerate(samples):
        outcome = [correct[(k, j)] if pol else int(s.verdicts[j]) for j, pol in enumerate(s.turn_is_policy)]
        rewards = turn_rewards([s.turn_ends], [s.turn_is_policy], [outcome], len(s.response_ids), g.alpha)
        item = items[s.index]
        trajs.append(Trajectory(
            uid=item.uid, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
            rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, score=float(rewards.sum()),
            acc=bool(outcome[_last_policy(s.turn_is_policy)]), data_source=item.data_source,
            policy_version=worker.policy_version, template_mask=list(s.template_mask), turn_ends=list(s.turn_ends),
            turn_is_policy=list(s.turn_is_policy), turn_outcome=outcome, routed_experts=s.routed_experts))
    return trajs, {k: float(v) for k, v in metrics.items()}


def _last_policy(is_policy: list[bool]) -> int:
    return max(j for j, p in enumerate(is_policy) if p)


def turn_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """first_accuracy: first policy turn correct; final_accuracy: last policy turn correct;
    verify_accuracy: verifier turns whose verdict equals the correctness of the answer they
    checked (a missing verdict counts wrong), over all verifier turns; verify_on_correct /
    verify_on_wrong: the same over the verifier turns that checked a correct / a wrong answer (a
    verifier that always says "wrong" scores 0 / 1 there, whatever the base rate; 0 when there
    were none); revised_frac: trajectories
    with a revision; verdict_missing_frac: verifier turns without a (unique) verdict;
    verdict_correct_frac: verifier turns saying "correct"."""
    multi = [t for t in trajs if t.turn_ends is not None]
    if not multi:
        return {}
    n = len(multi)
    checks = [(t.turn_outcome[j], _previous_answer(t, j)) for t in multi
              for j, pol in enumerate(t.turn_is_policy) if not pol]
    m = max(len(checks), 1)
    on = {a: [v == a for v, checked in checks if checked == a] for a in (0, 1)}
    return {
        "first_accuracy": sum(t.turn_outcome[0] == 1 for t in multi) / n,
        "final_accuracy": sum(t.turn_outcome[_last_policy(t.turn_is_policy)] == 1 for t in multi) / n,
        "verify_accuracy": sum(v == a for v, a in checks) / m,
        "verify_on_correct": sum(on[1]) / max(len(on[1]), 1),
        "verify_on_wrong": sum(on[0]) / max(len(on[0]), 1),
        "revised_frac": sum(sum(t.turn_is_policy) > 1 for t in multi) / n,
        "verdict_missing_frac": sum(v < 0 for v, _ in checks) / m,
        "verdict_correct_frac": sum(v == 1 for v, _ in checks) / m,
    }


def _previous_answer(t: Trajectory, j: int) -> int:
    return t.turn_outcome[max(k for k in range(j) if t.turn_is_policy[k])]


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    return {f"pag/{k}": v for k, v in turn_stats(trajs).items()}


def eval_metrics(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """<prefix>/first_accuracy, verify_accuracy, final_accuracy, ... of multi-turn trajectories."""
    return {f"{prefix}/{k}": v for k, v in turn_stats(trajs).items()}


# ---- advantages -------------------------------------------------------------------------------
def turn_tensors(turn_ends, turn_is_policy, turn_outcome) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample turn lists -> (turn_ends [B, K] long, -1 padded; turn_is_policy [B, K] bool;
    turn_outcome [B, K] long), K = the most turns of any sample."""
    B, K = len(turn_ends), max([1] + [len(e) for e in turn_ends])
    ends = torch.full((B, K), -1, dtype=torch.long)
    pol = torch.zeros(B, K, dtype=torch.bool)
    out = torch.full((B, K), -1, dtype=torch.long)
    for i, (e, p, o) in enumerate(zip(turn_ends, turn_is_policy, turn_outcome)):
        ends[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        pol[i, : len(p)] = torch.tensor(p, dtype=torch.bool)
        out[i, : len(o)] = torch.tensor(o, dtype=torch.long)
    return ends, pol, out


def turn_rewards(turn_ends, turn_is_policy, turn_outcome, T: int, alpha: float) -> torch.Tensor:
    """[B, T] PAG rewards (pairwise_pag.pag_turn_rewards) from per-sample turn lists; turn_outcome
    serves both as answer_correct (policy turns) and as verdict (verifier turns)."""
    ends, pol, out = turn_tensors(turn_ends, turn_is_policy, turn_outcome)
    return pag_turn_rewards(ends, pol, out.clamp(min=0), out, T, alpha)


def batch_turn_rewards(batch: StepBatch, cfg: MegaRLConfig) -> torch.Tensor:
    return turn_rewards(batch.turn_ends, batch.turn_is_policy, batch.turn_outcome, batch.width, cfg.algorithm.pag.alpha)


def generated_mask(batch: StepBatch) -> torch.Tensor:
    """[B, T] 1.0 on the tokens the policy generated (response minus template tokens)."""
    return batch.response_mask * (1.0 - batch.template_mask)


def advantage_layout(batch: StepBatch, cfg: MegaRLConfig) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(GAE mask: generated tokens, turn_starts [B, T] or None without turn_independent, role_ids [B, T])."""
    ends, pol, _ = turn_tensors(batch.turn_ends, batch.turn_is_policy, batch.turn_outcome)
    starts, roles = pag_turn_layout(ends, pol, batch.width)
    return generated_mask(batch), (starts if cfg.algorithm.pag.turn_independent else None), roles


def role_moments(x: torch.Tensor, mask: torch.Tensor, role_ids: torch.Tensor) -> torch.Tensor:
    """[len(ROLES), 3] float64 [count, sum, sum of squares] of x over the masked tokens of each
    role; a sum over DP ranks gives the whole batch's."""
    return torch.stack([masked_moments(x, mask * (role_ids == r).to(mask.dtype)) for r in ROLES])


def whiten_by_role(x: torch.Tensor, role_ids: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """RoleAdvNorm: (x - mean_r) / sqrt(var_r + 1e-8) at the tokens of role r, mean_r and (unbiased)
    var_r from `moments` (role_moments, reduced over DP); 0 where the role is neither."""
    out = torch.zeros_like(x)
    for k, r in enumerate(ROLES):
        mean, var = stats_from_moments(moments[k])
        sel = role_ids == r
        out = torch.where(sel, (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + WHITEN_EPS), out)
    return out


def whiten(adv: torch.Tensor, loss_mask: torch.Tensor, role_ids: torch.Tensor, cfg: MegaRLConfig,
           all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Advantages whitened over the policy-loss tokens of the whole batch (`all_reduce` sums over DP):
    per role with algorithm.pag.role_adv_norm, else all roles together."""
    roles = role_ids if cfg.algorithm.pag.role_adv_norm else torch.where(role_ids >= 0, POLICY_ROLE, role_ids)
    return whiten_by_role(adv, roles, all_reduce(role_moments(adv, loss_mask, roles)))
