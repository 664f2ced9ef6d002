"""Vectorised first-order linear recurrence run backwards in time.

`reverse_linear_scan(x, a)` computes, for every row independently,

    y_t = x_t + a_t * y_{t+1},   y_T = init (default 0),   t = T-1 .. 0

which is the backward recursion of GAE (x = delta, a = gamma*lam*m + (1-m)) and of discounted
returns. A closed form through cumulative products (y_t = sum_k prod_{j=t}^{k-1} a_j x_k) divides by
prod_{j<t} a_j, which underflows for long T (0.95**20480 ~ 1e-456) and is undefined when some
a_j = 0, so it is not used. Instead a two-level chunked scan:

1. split T into n chunks of C ~ sqrt(T) steps, laid out as a [C, B*n] matrix (one 2-D transpose
   copy); run the recursion inside all chunks at once with zero carry-in (a loop of C steps, each
   over one contiguous row of B*n values);
2. run the recursion over chunk boundaries (a loop of n steps over [B] vectors):
   y_start(c) = local_start(c) + P_c * y_start(c+1), P_c = prod of a over chunk c;
3. fix up: y_t = local_t + (prod_{j=t}^{end of chunk} a_j) * y_start(next chunk).

Only suffix products inside one chunk are formed (no division), so nothing can underflow in a way
that matters: a product below the float range is, correctly, ~0. Python loops: C + n ~ 2*sqrt(T)
steps on whole-batch tensors, instead of T (tools/bench/algorithms.py compares it with the loop
over T). No gradient flows through the scan (it is used for
advantage/return targets only).
"""

from __future__ import annotations

import math

import torch


def _chunk_size(T: int) -> int:
    """About sqrt(T), preferring a divisor of T (no padding copy)."""
    c0 = max(8, min(512, int(math.ceil(math.sqrt(T)))))
    for c in range(c0, max(8, c0 // 2) - 1, -1):
        if T % c == 0:
            return c
    return c0


@torch.no_grad()
def reverse_linear_scan(
    x: torch.Tensor, a: torch.Tensor, init: torch.Tensor | None = None, chunk: int | None = None
) -> torch.Tensor:
    """y_t = x_t + a_t * y_{t+1} along the last axis, y_T = init (default 0). x, a: [B, T]; init: [B]."""
    if x.shape != a.shape or x.dim() != 2:
        raise ValueError(f"reverse_linear_scan: x and a must both be [B, T], got {tuple(x.shape)} and {tuple(a.shape)}")
    B, T = x.shape
    if init is not None and tuple(init.shape) != (B,):
        raise ValueError(f"reverse_linear_scan: init must be [B] = [{B}], got {tuple(init.shape)}")
    if T == 0 or B == 0:
        return x.clone()
    C = min(chunk or _chunk_size(T), T)
    n = -(-T // C)
    pad = n * C - T
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=0.0)
        a = torch.nn.functional.pad(a, (0, pad), value=1.0)
    M = B * n
    # [C, M]: column (b, chunk), row j = step j of that chunk. A plain 2-D transpose (fast copy path).
    # Fresh buffers (never views of the inputs): they are overwritten in place below.
    xs = torch.empty((C, M), dtype=x.dtype, device=x.device).copy_(x.reshape(M, C).t())
    as_ = torch.empty((C, M), dtype=a.dtype, device=a.device).copy_(a.reshape(M, C).t())

    # 1. recursion inside every chunk with zero carry-in, in place: xs becomes local_j, as_ becomes
    #    suffix_j = prod_{i=j}^{C-1} a_i
    local, suffix = xs, as_
    for j in range(C - 2, -1, -1):
        local[j].addcmul_(as_[j], local[j + 1])
        suffix[j].mul_(suffix[j + 1])

    # 2. recursion over chunk boundaries: carry_in[b, c] = y at the first position of chunk c+1
    start_local = local[0].view(B, n)
    start_prod = suffix[0].view(B, n)
    carry_in = torch.empty_like(start_local)
    y_start = torch.zeros_like(start_local[:, 0]) if init is None else init.to(x.dtype)
    for c in range(n - 1, -1, -1):
        carry_in[:, c] = y_start
        y_start = torch.addcmul(start_local[:, c], start_prod[:, c], y_start)

    # 3. fix-up and transpose back
    local.addcmul_(suffix, carry_in.view(1, M))
    y = local.t().contiguous().view(B, n * C)
    return y[:, :T] if pad else y
