"""DAPO reward shaping and filters (docs/algorithms.md §2): soft overlong punishment, overlong filtering,
dynamic sampling."""

from __future__ import annotations

import torch

from .outcome import GroupIndex, group_ids


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment R_length (DAPO Eq. 13; verl form), float32 [B]. Added to the reward.

    With L_max = max_len, L_cache = cache_len, l = valid response length in tokens:
      0                                   if l <= L_max - L_cache
      factor * ((L_max - L_cache) - l) / L_cache   if L_max - L_cache < l <= L_max
      -factor                             if l > L_max
    verl's min(-(l - (L_max - L_cache))/L_cache * factor, 0) equals this for l <= L_max; beyond L_max
    (impossible with a hard cap) the paper's -1 is used.
    """
    if not (0 < cache_len <= max_len):
        raise ValueError(f"overlong_penalty: need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    l = lengths.to(torch.float32)
    soft = ((max_len - cache_len) - l) / cache_len * factor
    return soft.clamp(min=-factor, max=0.0)


def overlong_filter_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO): m' = m * (1 - truncated_b): every token of a truncated sample
    (hit the length cap without EOS) is removed from the loss. Same dtype as mask."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated has shape {tuple(truncated.shape)}, mask has {tuple(mask.shape)}")
    keep = (~truncated.bool()).unsqueeze(-1)
    return mask * keep.to(mask.dtype) if mask.dtype != torch.bool else mask & keep


def dynamic_sampling_keep(scores: torch.Tensor, group_index: GroupIndex, atol: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: which groups to keep. -> bool [G], one entry per unique group in order
    of first appearance in `group_index` (the numbering of `outcome.group_ids`).

    A group is kept iff max_g(score) - min_g(score) > atol, i.e. not all equal (0 < acc < 1 for 0/1
    correctness). Pass the correctness metric `acc`, not the shaped reward (docs/algorithms.md §2 pitfall).
    A group of size 1 is all-equal and dropped.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    ids, G = group_ids(group_index, scores.device)
    if ids.numel() != scores.numel():
        raise ValueError(f"group_index has {ids.numel()} entries but scores has {scores.numel()}")
    s = scores.to(torch.float64)
    gmax = torch.full((G,), float("-inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, reduce="amax")
    gmin = torch.full((G,), float("inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, reduce="amin")
    return (gmax - gmin) > atol


def dynamic_sampling_sample_mask(scores: torch.Tensor, group_index: GroupIndex, atol: float = 0.0) -> torch.Tensor:
    """Per-sample keep mask bool [N] for `dynamic_sampling_keep` (True = the sample's group is kept)."""
    keep = dynamic_sampling_keep(scores, group_index, atol)
    ids, _ = group_ids(group_index, scores.device)
    return keep[ids]
