"""Pairwise-RL reward/advantage (docs/algorithms.md §6) and PAG per-turn rewards and turn layout (§8).

PAG turn description, per row b and turn k (K = max turns in the batch, turns left-aligned):
- turn_ends [B, K] long: index (in the response's T axis) of the last token of turn k; -1 = no turn.
  Valid turns are a prefix of each row and their ends strictly increase.
- turn_is_policy [B, K] bool: True = policy (solution) turn, False = verifier turn.
Turn k covers positions end_{k-1}+1 .. end_k (template tokens in it carry m = 0).
"""

from __future__ import annotations

import torch

from .gae import compute_gae
from .outcome import place_outcome_reward

POLICY_ROLE, VERIFIER_ROLE = 0, 1


def pairwise_reward(p_first: torch.Tensor, p_second: torch.Tensor) -> torch.Tensor:
    """Position-debiased pairwise win probability ([NS→C], docs/algorithms.md §6), in [0, 1]:

    r = 1/2 * (P(policy > anchor | policy shown first) + 1 - P(anchor > policy | anchor shown first)),
    p_first = the judge's probability of "policy better" with the policy response first,
    p_second = its probability of "anchor better" with the anchor first. 0.5 = parity with the anchor.
    """
    for name, p in (("p_first", p_first), ("p_second", p_second)):
        if bool(((p < 0) | (p > 1) | p.isnan()).any()):
            raise ValueError(f"pairwise_reward: {name} must be probabilities in [0, 1]")
    return 0.5 * (p_first + 1.0 - p_second)


def pairwise_advantages(
    p_first: torch.Tensor,
    p_second: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    *,
    centre: float = 0.5,
    token_rewards: torch.Tensor | None = None,
    **gae_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise PPO advantage ([NS→C], docs/algorithms.md §6): terminal reward r - centre on the last valid
    token (r from `pairwise_reward`; centre 0.5 = the labelled common choice, 0.0 = raw r), plus
    optional per-token `token_rewards` (e.g. KL-in-reward), then `compute_gae`. -> (advantages, returns)."""
    r = pairwise_reward(p_first, p_second) - centre
    rewards = place_outcome_reward(r, mask)
    if token_rewards is not None:
        rewards = rewards + token_rewards.to(rewards.dtype)
    return compute_gae(rewards, values, mask, gamma, lam, **gae_kwargs)


def _check_turns(turn_ends: torch.Tensor, turn_is_policy: torch.Tensor, T: int) -> torch.Tensor:
    if turn_ends.dim() != 2 or turn_is_policy.shape != turn_ends.shape:
        raise ValueError(
            f"turn_ends and turn_is_policy must both be [B, K], got {tuple(turn_ends.shape)}, {tuple(turn_is_policy.shape)}"
        )
    valid = turn_ends >= 0
    if bool((turn_ends >= T).any()):
        raise ValueError(f"turn_ends: an index is >= T = {T}")
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("turn_ends: valid turns must be a prefix of each row (-1 only after the last turn)")
    if bool(((turn_ends[:, 1:] <= turn_ends[:, :-1]) & valid[:, 1:]).any()):
        raise ValueError("turn_ends: ends of a row's turns must strictly increase")
    return valid


def _prev_policy_turn(turn_is_policy: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, K] index of the last valid policy turn strictly before k, -1 if none."""
    B, K = turn_is_policy.shape
    k = torch.arange(K, device=turn_is_policy.device).expand(B, K)
    marked = torch.where(turn_is_policy.bool() & valid, k, torch.full_like(k, -1))
    incl = marked.cummax(-1).values
    return torch.cat([torch.full_like(incl[:, :1], -1), incl[:, :-1]], dim=1)


def pag_turn_rewards(
    turn_ends: torch.Tensor,
    turn_is_policy: torch.Tensor,
    answer_correct: torch.Tensor,
    verdict: torch.Tensor,
    T: int,
    alpha: float = 1.0,
) -> torch.Tensor:
    """PAG per-turn rewards (docs/algorithms.md §8) placed on the last token of each turn. -> float32 [B, T].

    answer_correct [B, K]: R_y of policy turn k (1 correct, 0 wrong); ignored on verifier turns.
    verdict [B, K] long: on verifier turn k, 1 = "The answer is correct", 0 = "The answer is wrong",
    -1 = missing or duplicated verdict; ignored on policy turns.
    - policy turn k:   R_y(k), plus the revision bonus alpha * (R_y(k) - R_y(p)) when an earlier
                       policy turn p (the most recent one) exists;
    - verifier turn k: R_v = 1 if verdict == R_y(p) for the most recent policy turn p before k,
                       else 0; a missing verdict (-1) gives 0.
    A verifier turn with no earlier policy turn is an error.
    """
    valid = _check_turns(turn_ends, turn_is_policy, T)
    is_pol = turn_is_policy.bool() & valid
    is_ver = ~turn_is_policy.bool() & valid
    prev = _prev_policy_turn(turn_is_policy, valid)
    if bool((is_ver & (prev < 0)).any()):
        raise ValueError("pag_turn_rewards: a verifier turn has no earlier policy turn to verify")
    ry = answer_correct.to(torch.float32)
    ry_prev = ry.gather(1, prev.clamp(min=0))
    has_prev = prev >= 0
    r_policy = ry + torch.where(has_prev, alpha * (ry - ry_prev), torch.zeros_like(ry))
    v = verdict.to(torch.long)
    r_verifier = ((v >= 0) & (v == ry_prev.round().to(torch.long))).to(torch.float32)
    r_turn = torch.where(is_pol, r_policy, torch.where(is_ver, r_verifier, torch.zeros_like(ry)))
    out = torch.zeros(turn_ends.shape[0], T, dtype=torch.float32, device=turn_ends.device)
    return out.scatter_add_(1, turn_ends.clamp(min=0), r_turn * valid.to(torch.float32))


def pag_turn_layout(turn_ends: torch.Tensor, turn_is_policy: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn_starts [B, T] bool, role_ids [B, T] long) for turn-independent GAE and RoleAdvNorm.

    turn_starts is True at end_k + 1 for every valid turn k except the row's last (the first position
    of turn k+1); role_ids is 0 (policy) / 1 (verifier) for positions of each turn, -1 after the
    row's last turn.
    """
    valid = _check_turns(turn_ends, turn_is_policy, T)
    B, K = turn_ends.shape
    ends = torch.where(valid, turn_ends, torch.full_like(turn_ends, T + 1)).contiguous()
    pos = torch.arange(T, device=turn_ends.device).expand(B, T).contiguous()
    turn_of_pos = torch.searchsorted(ends, pos, side="left")  # number of turn ends < t
    role_per_turn = torch.where(turn_is_policy.bool(), POLICY_ROLE, VERIFIER_ROLE)
    role_per_turn = torch.cat([role_per_turn, torch.full_like(role_per_turn[:, :1], -1)], dim=1)
    role_per_turn = torch.where(
        torch.cat([valid, torch.zeros_like(valid[:, :1])], dim=1), role_per_turn, torch.full_like(role_per_turn, -1)
    )
    role_ids = role_per_turn.gather(1, turn_of_pos.clamp(max=K))
    has_next = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    starts = torch.zeros(B, T + 1, dtype=torch.bool, device=turn_ends.device)
    starts.scatter_(1, torch.where(has_next, turn_ends + 1, torch.full_like(turn_ends, T)), True)
    return starts[:, :T], role_ids
