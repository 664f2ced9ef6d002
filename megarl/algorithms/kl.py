"""KL estimators (docs/algorithms.md §1.8), KL-in-reward and its fixed/adaptive coefficient controllers.

x = logp_theta - logp_ref per token (samples from pi_theta). Estimators of KL(pi_theta || pi_ref):
k1 = x; k2 = x^2/2 ("mse"); k3 = exp(-x) + x - 1 ("low_var_kl": x clamped to [-20, 20], result to
[-10, 10], as verl); abs = |x|. No reduction: per-token tensors. For the KL-loss form (GRPO) use
`agg_loss(kl_penalty(...), mask, mode)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import KL_PENALTIES


@KL_PENALTIES.register("k1", "kl")
def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


@KL_PENALTIES.register("k2", "mse")
def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


@KL_PENALTIES.register("k3", "low_var_kl")
def _k3(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(-20.0, 20.0)
    return (torch.exp(-x) + x - 1.0).clamp(-10.0, 10.0)


@KL_PENALTIES.register("abs")
def _abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs()


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate with x = log_probs - ref_log_probs; kind in k1|kl, k2|mse, k3|low_var_kl, abs."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"kl_penalty: shapes differ {tuple(log_probs.shape)} vs {tuple(ref_log_probs.shape)}")
    return KL_PENALTIES[kind](log_probs - ref_log_probs)


def apply_kl_in_reward(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward (classic PPO): r_t = score_t - beta * k_t * m_t. -> (token_rewards, current_kl).

    current_kl = mean over rows with >= 1 token of (sum_t m*k / sum_t m) (sequence mean of per-row
    token means, verl's statistic) — feed it to `AdaptiveKLController.update`.
    """
    k = kl_penalty(log_probs, ref_log_probs, kind).to(token_scores.dtype)
    m = mask.to(token_scores.dtype)
    rewards = token_scores - beta * k * m
    with torch.no_grad():
        per_row = (k * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        nonempty = (m.sum(-1) > 0).to(m.dtype)
        current_kl = (per_row * nonempty).sum() / nonempty.sum().clamp(min=1.0)
    return rewards, current_kl


@dataclass
class FixedKLController:
    """Constant KL coefficient beta."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, as in verl).

    On update: e = clip(current_kl / target_kl - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon).
    `n_steps` is the number of samples (or steps) since the last update.
    """

    value: float
    target_kl: float
    horizon: float

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl and horizon must be > 0, got {self}")

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
