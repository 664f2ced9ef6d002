"""Outcome-reward placement and critic-free advantages: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline).

Groups: `group_index` identifies the prompt (uid) of each sample: an integer tensor [N], or any
sequence of hashables (e.g. uid strings). Groups are numbered in order of first appearance.
Compute these over the full rollout batch before sharding across ranks (docs/algorithms.md §1.5 pitfall).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .gae import discounted_returns
from .masked import last_valid_index, masked_whiten

GroupIndex = torch.Tensor | Sequence[Hashable]


def group_ids(group_index: GroupIndex, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """(ids [N] long in 0..G-1 numbered by first appearance, G)."""
    if not isinstance(group_index, torch.Tensor):
        table: dict = {}
        ids = [table.setdefault(g, len(table)) for g in group_index]
        return torch.tensor(ids, dtype=torch.long, device=device), len(table)
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [N], got shape {tuple(group_index.shape)}")
    uniq, inv = torch.unique(group_index, return_inverse=True)
    G, N = uniq.numel(), group_index.numel()
    pos = torch.arange(N, device=group_index.device)
    first = torch.full((G,), N, dtype=torch.long, device=group_index.device).scatter_reduce(
        0, inv, pos, reduce="amin"
    )
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(G, device=first.device)
    return rank[inv], G


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, G: int):
    """Per-group count, mean and unbiased std (std = 1 where count < 2), gathered back to [N]."""
    s = scores
    count = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, ids, torch.ones_like(s))
    mean = torch.zeros_like(count).index_add_(0, ids, s) / count
    dev = s - mean[ids]
    ss = torch.zeros_like(count).index_add_(0, ids, dev * dev)
    std = torch.where(count > 1, (ss / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(ss))
    return count[ids], mean[ids], std[ids]


def _scores_1d(scores: torch.Tensor, group_index: GroupIndex) -> tuple[torch.Tensor, torch.Tensor, int]:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    ids, G = group_ids(group_index, scores.device)
    if ids.numel() != scores.numel():
        raise ValueError(f"group_index has {ids.numel()} entries but scores has {scores.numel()}")
    dt = torch.float64 if scores.dtype == torch.float64 else torch.float32
    return scores.to(dt), ids.to(scores.device), G


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, group_index: GroupIndex, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage (docs/algorithms.md §1.5), [N].

    A_i = (s_i - mean_g) / (std_g + eps), mean over the group's samples (denominator n_g), std the
    unbiased group std (denominator n_g - 1). A group of size 1 uses mean 0, std 1 (verl), so its
    advantage is s_i/(1 + eps). `norm_by_std=False` (Dr. GRPO) gives A_i = s_i - mean_g.
    A group with all-equal scores gets 0.
    """
    s, ids, G = _scores_1d(scores, group_index)
    count, mean, std = _group_stats(s, ids, G)
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))
    adv = s - mean
    return adv / (std + eps) if norm_by_std else adv


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_index: GroupIndex) -> torch.Tensor:
    """RLOO (docs/algorithms.md §1.6), [N]: A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g).

    A group of size 1 has no other sample: its baseline is 0 and A_i = s_i (verl).
    """
    s, ids, G = _scores_1d(scores, group_index)
    count, mean, _ = _group_stats(s, ids, G)
    loo = count / (count - 1).clamp(min=1) * (s - mean)
    return torch.where(count > 1, loo, s)


def broadcast_to_tokens(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: x_i on every masked-in token of row i, 0 elsewhere."""
    if per_seq.shape != mask.shape[:1]:
        raise ValueError(f"per-sequence tensor has shape {tuple(per_seq.shape)}, mask has {tuple(mask.shape)}")
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def place_outcome_reward(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] token rewards: score_i on the last masked-in token of row i, 0 elsewhere.

    The last valid token is EOS, or the last token of a truncated response (docs/algorithms.md §0). A row
    whose mask is all 0 has no token to carry its reward: that row is all 0.
    """
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, mask has {tuple(mask.shape)}")
    dt = torch.float64 if scores.dtype == torch.float64 else torch.float32
    out = torch.zeros(mask.shape, dtype=dt, device=mask.device)
    idx, has_any = last_valid_index(mask)
    src = torch.where(has_any, scores.to(dt), torch.zeros_like(scores, dtype=dt))
    return out.scatter_(1, idx.unsqueeze(1), src.unsqueeze(1))


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    group_index: GroupIndex | None = None,
) -> torch.Tensor:
    """REINFORCE++ (docs/algorithms.md §1.7), [B, T].

    Without `group_index`: G_t = sum_{k>=t} gamma^{k-t} r_k over masked-in tokens (reset after
    EOS, `discounted_returns`), then A = whiten(G) over all masked tokens of the whole batch
    (unbiased var, eps 1e-8) — not per group.
    With `group_index` (REINFORCE++-baseline): s_i = sum_t m*r; A = whiten(broadcast(s_i - mean_g))
    over the whole batch, mean_g over the group (0 for a group of size 1); gamma is unused.
    """
    if group_index is None:
        return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)
    dt = torch.float64 if token_rewards.dtype == torch.float64 else torch.float32
    s = (token_rewards.to(dt) * mask.to(dt)).sum(-1)
    s, ids, G = _scores_1d(s, group_index)
    count, mean, _ = _group_stats(s, ids, G)
    centred = s - torch.where(count > 1, mean, torch.zeros_like(mean))
    return masked_whiten(broadcast_to_tokens(centred, mask), mask)
