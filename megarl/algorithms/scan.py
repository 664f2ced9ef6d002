"""Vectorised first-order linear recurrence run backwards in time.

`reverse_linear_scan(x, a)` computes, for every row independently,

    y_t = x_t + a_t * y_{t+1},   y_T = 0,   t = T-1 .. 0

which is the backward recursion of GAE (x = delta, a = gamma*lam*m + (1-m)) and of discounted
returns. A closed form through cumulative products (y_t = sum_k prod_{j=t}^{k-1} a_j x_k) divides by
prod_{j<t} a_j, which underflows for long T (0.95**20480 ~ 1e-456) and is undefined when some
a_j = 0, so it is not used. Instead a two-level chunked scan:

1. split T into n chunks of C ~ sqrt(T) steps; run the recursion inside all chunks at once with zero
   carry-in (a loop of C steps over [B, n] tensors);
2. run the recursion over chunk boundaries (a loop of n steps over [B] vectors):
   y_start(c) = local_start(c) + P_c * y_start(c+1), P_c = prod of a over chunk c;
3. fix up: y_t = local_t + (prod_{j=t}^{end of chunk} a_j) * y_start(next chunk).

Only suffix products inside one chunk are formed (no division), so nothing can underflow in a way
that matters: a product below the float range is, correctly, ~0. Python loops: C + n ~ 2*sqrt(T)
steps on whole-batch tensors, instead of T.
"""

from __future__ import annotations

import math

import torch


def _chunk_size(T: int) -> int:
    return max(8, min(512, int(math.ceil(math.sqrt(T)))))


def reverse_linear_scan(x: torch.Tensor, a: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """y_t = x_t + a_t * y_{t+1} along the last axis, y_T = 0. x, a: [B, T] -> y: [B, T]."""
    if x.shape != a.shape or x.dim() != 2:
        raise ValueError(f"reverse_linear_scan: x and a must both be [B, T], got {tuple(x.shape)} and {tuple(a.shape)}")
    B, T = x.shape
    if T == 0 or B == 0:
        return x.clone()
    C = chunk or _chunk_size(T)
    n = -(-T // C)
    pad = n * C - T
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=0.0)
        a = torch.nn.functional.pad(a, (0, pad), value=1.0)
    # [C, B, n]: step j of every chunk is one contiguous slice.
    xs = x.view(B, n, C).permute(2, 0, 1).contiguous()
    as_ = a.view(B, n, C).permute(2, 0, 1).contiguous()

    local = torch.empty_like(xs)
    carry = torch.zeros_like(xs[0])
    for j in range(C - 1, -1, -1):
        carry = torch.addcmul(xs[j], as_[j], carry)
        local[j] = carry

    # suffix[j] = prod_{i=j}^{C-1} a_i inside each chunk
    suffix = as_.flip(0).cumprod(0).flip(0)

    # y at the start of chunk c+1, i.e. the carry into chunk c; zero after the last chunk
    carry_in = torch.empty_like(xs[0])  # [B, n]
    y_start = torch.zeros_like(carry_in[:, 0])
    for c in range(n - 1, -1, -1):
        carry_in[:, c] = y_start
        y_start = torch.addcmul(local[0, :, c], suffix[0, :, c], y_start)

    y = torch.addcmul(local, suffix, carry_in.unsqueeze(0))
    y = y.permute(1, 2, 0).reshape(B, n * C)
    return y[:, :T] if pad else y
