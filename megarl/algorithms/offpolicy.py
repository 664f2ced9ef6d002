"""Off-policy corrections between the rollout engine's sampling distribution and the trainer's.

The engine reports logp_roll, the log-probability of each sampled token under the distribution
it was drawn from; the trainer recomputes logp_old under the current weights (docs/algorithms.md §0).
They differ because the engine's kernels differ numerically (train/inference mismatch) and, for
T-PPO carried samples or stale rollouts, because an older policy version sampled the tokens.
Per token:

    rho_t = exp(clamp(logp_old_t - logp_roll_t, -20, 20))

- TIS, truncated importance sampling (`rollout_is: tis`; Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"; verl `rollout_is_mode: truncate` [R]):
  w_t = min(rho_t, C). Every token stays in the loss; its policy-gradient term is weighted by w_t.
- MIS, masked importance sampling (`rollout_is: mis`; verl `rollout_is_mode: mask` with an upper
  threshold only [R]): tokens with rho_t > C leave the policy loss (its mask, hence also its
  denominator); the remaining tokens are weighted by w_t = rho_t.

The weights are constants (no gradient). The trainer applies w_t to the advantage of token t,
which for every policy loss linear in the per-token advantage with a sign-only dependence
(ppo clipped / dual-clip, vanilla_pg, cispo, sapo, gpg) equals weighting that token's
policy-gradient loss, because w_t > 0 commutes with the max/min of the clipped surrogate.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
MODES = ("tis", "mis")
# policy losses where scaling token t's advantage by w_t > 0 is exactly weighting its loss term
WEIGHTABLE_LOSSES = ("ppo", "vanilla_pg", "cispo", "sapo", "gpg")


def rollout_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """rho = exp(clamp(logp_old - logp_roll, -20, 20)), [B, T] float32 (float64 for float64 inputs)."""
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"old log-probs {tuple(old_logprobs.shape)} and rollout log-probs "
                         f"{tuple(rollout_logprobs.shape)} differ in shape")
    dt = torch.float64 if torch.float64 in (old_logprobs.dtype, rollout_logprobs.dtype) else torch.float32
    return torch.exp((old_logprobs.to(dt) - rollout_logprobs.to(dt)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@torch.no_grad()
def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (weights [B, T], mask after the correction [B, T], local statistics [5]).

    tis: w = min(rho, C), mask unchanged. mis: w = rho, mask' = mask * (rho <= C). Weights are 0
    where `mask` is 0. Statistics over the tokens of the incoming `mask`, as float64 sums that
    data-parallel ranks add up, except the last entry which they reduce with MAX:
    [tokens, sum rho, tokens with rho > C, sum w (kept tokens), max rho] (max 0 with no token).
    """
    if mode not in MODES:
        raise ValueError(f"rollout_is: unknown mode {mode!r} (one of {MODES})")
    if cap < 1.0:
        raise ValueError(f"rollout_is: the cap / threshold C must be >= 1, got {cap}")
    rho = rollout_ratio(old_logprobs, rollout_logprobs)
    m = mask.to(rho.dtype)
    above = (rho > cap).to(rho.dtype) * m
    if mode == "tis":
        weights, kept = rho.clamp(max=cap) * m, m
    else:
        kept = m - above
        weights = rho * kept
    n = m.sum()
    stats = torch.stack([n, (rho * m).sum(), above.sum(), weights.sum(),
                         (rho * m).max() if m.numel() else n.new_zeros(())]).double()
    return weights.to(mask.dtype if mask.is_floating_point() else torch.float32), kept.to(mask.dtype), stats


def rollout_is_metrics(stats: torch.Tensor, mode: str) -> dict[str, float]:
    """Metrics from (DP-reduced) `rollout_is_weights` statistics: ratio mean / max over the policy
    tokens, the fraction capped (tis) or masked (mis), and the mean weight applied."""
    n, s_rho, n_above, s_w, max_rho = (float(x) for x in stats)
    den = max(n, 1.0)
    kept = n - n_above if mode == "mis" else n
    return {"rollout_is/ratio_mean": s_rho / den, "rollout_is/ratio_max": max_rho,
            f"rollout_is/{'capped' if mode == 'tis' else 'masked'}_frac": n_above / den,
            "rollout_is/weight_mean": s_w / max(kept, 1.0)}
