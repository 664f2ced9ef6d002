"""Advantage estimators behind the config names (`advantage: gae | egae | grpo | rloo | reinforce_pp |
reinforce_pp_baseline`; remax, opo, gpg in objectives.py), all with one signature:

    ADVANTAGES[name](inputs: AdvantageInputs, params: AdvantageParams) -> (advantages [B, T], returns [B, T])

GAE family: advantages are whitened over the whole batch when params.whiten (verl), or per role
(RoleAdvNorm) when inputs.role_ids is given; returns are the critic targets (never whitened).
Critic-free estimators return returns = advantages (verl convention; no critic consumes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gae import compute_egae, decoupled_gae, length_adaptive_lambda
from .masked import masked_whiten, masked_whiten_by_role
from .outcome import GroupIndex, broadcast_to_tokens, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from .registry import ADVANTAGES


@dataclass
class AdvantageInputs:
    """Tensors an estimator may use. token_rewards, mask: [B, T]; values: [B, T] (critic, GAE family);
    group_index: [N = B] prompt uid (group estimators); truncated: [B] bool (EGAE);
    turn_starts: [B, T] bool (PAG turn-independent GAE); role_ids: [B, T] (PAG RoleAdvNorm);
    baseline_scores: [B] per-sample baseline reward (ReMax: the greedy response's reward);
    lengths: [B] response tokens per sample (default mask.sum(-1); the trainer passes them when it
    hands a critic-free estimator one token per sample, megarl.trainer.rl.compute_advantages)."""

    token_rewards: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None
    group_index: GroupIndex | None = None
    truncated: torch.Tensor | None = None
    turn_starts: torch.Tensor | None = None
    role_ids: torch.Tensor | None = None
    baseline_scores: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.mask.sum(-1) if self.lengths is None else self.lengths


@dataclass
class AdvantageParams:
    """gamma, lam: GAE discount and actor lambda (verl defaults 1.0). lam_critic: lambda of the critic
    returns (None = lam; VC-PPO/VAPO use 1.0 with lam 0.95). length_adaptive_alpha: VAPO alpha
    (e.g. 0.05) replacing lam by 1 - 1/(alpha*l) per sequence. whiten: whiten GAE advantages.
    norm_by_std, eps: GRPO (norm_by_std=False is Dr. GRPO). gpg_alpha, gpg_norm_by_std: GPG's
    B/(B-M) correction and std normaliser (objectives.gpg_advantages)."""

    gamma: float = 1.0
    lam: float = 1.0
    lam_critic: float | None = None
    length_adaptive_alpha: float | None = None
    whiten: bool = True
    norm_by_std: bool = True
    eps: float = 1e-6
    gpg_alpha: bool = True
    gpg_norm_by_std: bool = False


def _need(inputs: AdvantageInputs, field: str, estimator: str):
    val = getattr(inputs, field)
    if val is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
    return val


def _whiten(adv: torch.Tensor, inputs: AdvantageInputs, params: AdvantageParams) -> torch.Tensor:
    if not params.whiten:
        return adv
    if inputs.role_ids is not None:
        return masked_whiten_by_role(adv, inputs.mask, inputs.role_ids)
    return masked_whiten(adv, inputs.mask)


def _actor_lambda(inputs: AdvantageInputs, params: AdvantageParams) -> float | torch.Tensor:
    if params.length_adaptive_alpha is None:
        return params.lam
    return length_adaptive_lambda(inputs.mask.sum(-1), params.length_adaptive_alpha)


@ADVANTAGES.register("gae")
def gae_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(Decoupled, length-adaptive, turn-independent) GAE: `gae.decoupled_gae` then whitening."""
    values = _need(inputs, "values", "gae")
    lam_c = params.lam if params.lam_critic is None else params.lam_critic
    adv, ret = decoupled_gae(
        inputs.token_rewards, values, inputs.mask, params.gamma, _actor_lambda(inputs, params), lam_c,
        turn_starts=inputs.turn_starts,
    )
    return _whiten(adv, inputs, params), ret


@ADVANTAGES.register("egae")
def egae_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """T-PPO EGAE (`gae.compute_egae`; truncated rows bootstrap V(s_l) ~ V(s_{l-1})), then whitening."""
    values = _need(inputs, "values", "egae")
    truncated = _need(inputs, "truncated", "egae")
    lam_c = params.lam if params.lam_critic is None else params.lam_critic
    adv, ret = compute_egae(
        inputs.token_rewards, values, inputs.mask, truncated, params.gamma, _actor_lambda(inputs, params),
        lam_critic=lam_c, turn_starts=inputs.turn_starts,
    )
    return _whiten(adv, inputs, params), ret


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    """s_i = sum_t m * r (outcome score, including any per-token reward terms)."""
    r = inputs.token_rewards
    dt = torch.float64 if r.dtype == torch.float64 else torch.float32
    return (r.to(dt) * inputs.mask.to(dt)).sum(-1)


@ADVANTAGES.register("grpo")
def grpo_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO / Dr. GRPO: `outcome.grpo_advantages` on s_i, broadcast to every masked token."""
    group_index = _need(inputs, "group_index", "grpo")
    adv = broadcast_to_tokens(grpo_advantages(_scores(inputs), group_index, params.norm_by_std, params.eps), inputs.mask)
    return adv, adv


@ADVANTAGES.register("rloo")
def rloo_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: `outcome.rloo_advantages` on s_i, broadcast to every masked token."""
    group_index = _need(inputs, "group_index", "rloo")
    adv = broadcast_to_tokens(rloo_advantages(_scores(inputs), group_index), inputs.mask)
    return adv, adv


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: globally whitened discounted returns (`outcome.reinforce_pp_advantages`)."""
    adv = reinforce_pp_advantages(inputs.token_rewards, inputs.mask, params.gamma)
    return adv, adv


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(
    inputs: AdvantageInputs, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: group-mean-subtracted score, broadcast, whitened over the whole batch."""
    group_index = _need(inputs, "group_index", "reinforce_pp_baseline")
    adv = reinforce_pp_advantages(inputs.token_rewards, inputs.mask, params.gamma, group_index=group_index)
    return adv, adv


def compute_advantages(name: str, inputs: AdvantageInputs, params: AdvantageParams | None = None):
    """ADVANTAGES[name](inputs, params or AdvantageParams()) -> (advantages, returns)."""
    return ADVANTAGES[name](inputs, params or AdvantageParams())
