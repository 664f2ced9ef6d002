"""T-PPO token filtering and sample bookkeeping (docs/algorithms.md §5), as pure functions.

A T-PPO response is generated in windows: at step k every active sample gets at most
`window_tokens` new tokens under policy version k. For sample b, `window_start[b]` is the
response index of the first token of its current window (0 for a sample started this step), and
the sample is "unfinished" when the window ended before the response did.

- The policy loss covers the tokens of the current window only (the paper does not say whether
  a continuing response's earlier windows are re-trained; docs/algorithms.md §5 [NS→C]: the safest
  reading is no). `retrain_earlier_windows=True` gives the other reading: every response token.
- The value loss covers finished samples only (every response token, Monte-Carlo targets); the
  tokens of unfinished samples are filtered out.
- Prompt tokens are never in either mask (masks are response-aligned).
EGAE itself is `gae.compute_egae`; advantages at the current window's tokens depend only on
later tokens, so computing them over the whole response so far gives the same values there.
"""

from __future__ import annotations

import torch


def window_mask(response_mask: torch.Tensor, window_start: torch.Tensor) -> torch.Tensor:
    """[B, T]: m_{b,t} = response_mask_{b,t} * [t >= window_start_b] (tokens of the current window)."""
    B, T = response_mask.shape
    if tuple(window_start.shape) != (B,):
        raise ValueError(f"window_start: expected shape ({B},), got {tuple(window_start.shape)}")
    cols = torch.arange(T, device=response_mask.device)
    return response_mask * (cols[None, :] >= window_start.to(response_mask.device)[:, None]).to(response_mask.dtype)


def tppo_masks(response_mask: torch.Tensor, window_start: torch.Tensor, unfinished: torch.Tensor,
               retrain_earlier_windows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy mask, value mask), [B, T] each: the current window's tokens (every response token
    with retrain_earlier_windows), and every response token of the finished samples."""
    policy = response_mask if retrain_earlier_windows else window_mask(response_mask, window_start)
    value = response_mask * (~unfinished.bool()).to(response_mask.dtype).unsqueeze(1)
    return policy, value


def staleness(policy_version: torch.Tensor, start_version: torch.Tensor) -> torch.Tensor:
    """[B] policy updates a response spans: version of its latest window - version of its first."""
    return policy_version - start_version


def staleness_histogram(ages: list[int]) -> dict[int, int]:
    """{age: number of samples} for ages 0..max(ages) (zeros included), {} for no samples."""
    if not ages:
        return {}
    return {a: sum(1 for x in ages if x == a) for a in range(max(ages) + 1)}
