"""Masked reductions, whitening (docs/algorithms.md §1.3, §8 RoleAdvNorm) and explained variance.

Shapes: x, mask [B, T]; mask is 1 (or True) on tokens that count. All statistics are over the
masked tokens of the tensors passed in. Whitening statistics must be global (whole rollout batch):
call these before sharding, or all-reduce `masked_moments` across ranks and pass `stats=`.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def _as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(like.shape)}")
    return mask.to(like.dtype) if like.is_floating_point() else mask.float()


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) over `dim` (all dims when None)."""
    m = _as_float_mask(mask, x)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) / sum(m) over `dim`; a slice with sum(m) = 0 gives 0 (its denominator is clamped to 1)."""
    m = _as_float_mask(mask, x)
    num = (x * m).sum() if dim is None else (x * m).sum(dim)
    den = m.sum() if dim is None else m.sum(dim)
    return num / den.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """sum(m * (x - mean)^2) / (sum(m) - 1) (unbiased) or / sum(m); 0 when sum(m) < 2 (unbiased)."""
    m = _as_float_mask(mask, x)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1.0)
    ss = (((x - mean) ** 2) * m).sum()
    den = (n - 1.0) if unbiased else n
    return torch.where(den > 0, ss / den.clamp(min=1.0), torch.zeros_like(ss))


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, sum(x), sum(x^2)] over masked tokens, in float64 so that ranks can all-reduce (SUM) it.

    Pass the reduced result to `stats_from_moments` and then `masked_whiten(..., stats=...)` to
    whiten with statistics of the global batch.
    """
    m = _as_float_mask(mask, x).double()
    xd = x.double()
    return torch.stack([m.sum(), (xd * m).sum(), (xd * xd * m).sum()])


def stats_from_moments(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased var) from [count, sum, sum_sq]: var = (sum_sq - count*mean^2)/(count - 1); 0 if count < 2."""
    n, s, ss = moments.unbind()
    mean = s / n.clamp(min=1.0)
    var = ((ss - n * mean * mean) / (n - 1.0).clamp(min=1.0)).clamp(min=0.0)
    return mean, torch.where(n > 1, var, torch.zeros_like(var))


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked tokens (docs/algorithms.md §1.3); 0 at masked-out positions.

    mean = sum(m*x)/sum(m); var is unbiased: sum(m*(x-mean)^2)/(sum(m)-1) (taken as 0 when only one
    token is masked in, so that token whitens to 0). `shift_mean=False` adds the mean back (verl
    option). `stats=(mean, var)` overrides the local statistics (global whitening across ranks).
    Raises ValueError if the mask selects no token and no stats are given.
    """
    m = _as_float_mask(mask, x)
    if stats is None:
        if not bool(m.sum() > 0):
            raise ValueError("masked_whiten: mask selects no token; whitening statistics are undefined")
        mean = (x * m).sum() / m.sum()
        var = masked_var(x, mask)
    else:
        mean, var = stats
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m


def masked_whiten_by_role(x: torch.Tensor, mask: torch.Tensor, role_ids: torch.Tensor) -> torch.Tensor:
    """RoleAdvNorm (PAG, docs/algorithms.md §8): whiten separately over the masked tokens of each role.

    role_ids: [B, T] integer role per token (e.g. 0 = policy turn, 1 = verifier turn). For each
    role r present among masked tokens: x <- (x - mean_r)/sqrt(var_r + 1e-8) with mean_r, var_r
    (unbiased, denominator count_r - 1) over tokens with m = 1 and role = r. Masked-out positions
    give 0. A role with a single token whitens it to 0.
    """
    if role_ids.shape != x.shape:
        raise ValueError(f"role_ids shape {tuple(role_ids.shape)} does not match {tuple(x.shape)}")
    m = _as_float_mask(mask, x)
    roles, inv = torch.unique(role_ids, return_inverse=True)
    R = roles.numel()
    flat_inv, flat_m, flat_x = inv.reshape(-1), m.reshape(-1), x.reshape(-1)
    count = torch.zeros(R, dtype=x.dtype, device=x.device).index_add_(0, flat_inv, flat_m)
    total = torch.zeros_like(count).index_add_(0, flat_inv, flat_x * flat_m)
    mean = total / count.clamp(min=1.0)
    dev = flat_x - mean[flat_inv]
    ss = torch.zeros_like(count).index_add_(0, flat_inv, dev * dev * flat_m)
    var = torch.where(count > 1, ss / (count - 1.0).clamp(min=1.0), torch.zeros_like(ss))
    out = dev * torch.rsqrt(var[flat_inv] + WHITEN_EPS)
    return (out * flat_m).view_as(x)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EV = 1 - Var(returns - values)/Var(returns) over masked tokens (docs/algorithms.md §3, [NS→C] standard form).

    Both variances use the same (unbiased) denominator, so it cancels. Returns NaN when
    Var(returns) = 0 (EV undefined).
    """
    var_r = masked_var(returns, mask)
    var_d = masked_var(returns - values, mask)
    return torch.where(var_r > 0, 1.0 - var_d / var_r, torch.full_like(var_r, float("nan")))


def last_valid_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the last position with m = 1 per row [B] (0 for empty rows), has_any [B] bool)."""
    mb = mask.bool()
    T = mb.shape[-1]
    has_any = mb.any(-1)
    idx = (T - 1) - mb.flip(-1).to(torch.uint8).argmax(-1)
    return torch.where(has_any, idx, torch.zeros_like(idx)), has_any
