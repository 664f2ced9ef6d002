"""The kernels behind megarl's local core attention (`megarl.models.attention.LocalAttention`).

All three compute causal attention within the sequences of a packed (THD) row,

    out[i] = sum_j softmax_j(q_i . k_j * scale) v_j   over the keys j of i's sequence at positions <= i's,

with grouped-query attention (h query heads share h / g key/value heads, head n reads group
n // (h / g)), values as wide as the queries or not (multi-latent attention: 192 / 128), and
differ only in how:

- `varlen` (CUDA, bf16 / fp16): PyTorch's FlashAttention varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`). Causality is the kernel's bottom-right aligned mask,
  which also serves context parallelism: a CP rank's query chunk is one segment whose keys are the
  whole prefix of its sequence up to the chunk's end (`cp_prefix_segments`).
- `sdpa` (any device, CP = 1): `torch.nn.functional.scaled_dot_product_attention` with
  `is_causal=True` on sequences of similar length stacked into a padded batch
  (`length_groups`). Padding sits after each sequence's last token, so under the causal mask no
  real query ever sees it and the result is exact; on CPU this runs torch's fused flash kernel.
- `blockwise` (any device, any CP): the FlashAttention recurrences in plain torch, query block by
  query block (`megarl.models.attention_blockwise`); the fallback and the reference.

`select_kernel` picks one; `forced_kernel(name)` overrides the choice (benchmarks, checks).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.models.kernel_choice import KernelChoice

KERNELS = ("auto", "varlen", "sdpa", "blockwise")
VARLEN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dimension
SDPA_MAX_PADDING = 2.0  # a padded group holds at most this many times its real tokens

_choice = KernelChoice("attention kernel", KERNELS)


def use_kernel(name: str) -> None:
    """From now on every local attention of this process uses `name` ("auto": the choice of
    `select_kernel`); `model.attention_kernel`, set when a model is built."""
    _choice.use(name)


def forced_kernel(name: str):
    """Within the block, every local attention uses `name` ("auto" restores the choice)."""
    return _choice.forced(name)


def varlen_function():
    """`torch.nn.attention.varlen.varlen_attn`, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def select_kernel(device_type: str, dtype: torch.dtype, cp_size: int, forced: str | None = None,
                  has_varlen: bool | None = None, cuda_runtime: bool | None = None) -> str:
    """The kernel for queries of this device and dtype at this CP size: varlen on CUDA in half
    precision, else sdpa at CP = 1, else blockwise. A forced kernel that cannot run here is an
    error (varlen needs CUDA, half precision and torch's varlen module; sdpa needs CP = 1).
    `cuda_runtime` (default: torch.cuda.is_available()) tells a real GPU from the CPU runtime's
    strict device mode, whose device tensors report "cuda" but live on the host."""
    forced = _choice.name if forced is None else forced
    has_varlen = varlen_function() is not None if has_varlen is None else has_varlen
    cuda_runtime = torch.cuda.is_available() if cuda_runtime is None else cuda_runtime
    varlen_ok = device_type == "cuda" and cuda_runtime and dtype in VARLEN_DTYPES and has_varlen
    if forced == "varlen" and not varlen_ok:
        raise ValueError(f"attention kernel 'varlen' needs CUDA, bf16/fp16 and torch.nn.attention.varlen "
                         f"(here: {device_type}, {dtype}, varlen module {'present' if has_varlen else 'absent'})")
    if forced == "sdpa" and cp_size > 1:
        raise ValueError("attention kernel 'sdpa' runs without context parallelism (cp=1)")
    if forced != "auto":
        return forced
    if varlen_ok:
        return "varlen"
    return "sdpa" if cp_size == 1 else "blockwise"


# ---- sdpa: padded groups of similar length --------------------------------------------------

def length_groups(lengths: list[int], max_padding: float = SDPA_MAX_PADDING) -> list[list[int]]:
    """Sequences (indices into `lengths`, zero lengths dropped) grouped for padded batches: by
    length, longest first, a group closed when padding every member to its longest would exceed
    `max_padding` times the group's real tokens. Memory stays within that factor of the row."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_padding * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


@dataclass
class PaddedGroup:
    """Where a group's tokens sit in the packed row (`rows`) and in its padded [n, L] batch
    (`slots`, flat indices n_i * L + position)."""

    size: int
    longest: int
    rows: torch.Tensor
    slots: torch.Tensor


def padded_groups(cu_seqlens: list[int], device=None) -> tuple[list[PaddedGroup], torch.Tensor]:
    """The groups of `length_groups` for a packed row and the permutation that puts the
    concatenated group outputs back in row order."""
    lengths = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    groups, order = [], []
    for members in length_groups(lengths):
        longest = lengths[members[0]]
        rows = torch.cat([torch.arange(cu_seqlens[i], cu_seqlens[i + 1]) for i in members])
        slots = torch.cat([j * longest + torch.arange(lengths[i]) for j, i in enumerate(members)])
        groups.append(PaddedGroup(len(members), longest, rows.to(device), slots.to(device)))
        order.append(rows)
    order_t = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty_like(order_t)
    inverse[order_t] = torch.arange(order_t.numel())
    return groups, inverse.to(device)


def _to_padded(x: torch.Tensor, g: PaddedGroup) -> torch.Tensor:
    """[t, heads, d] rows of the group -> [n, heads, L, d] (zeros after each sequence)."""
    flat = x.new_zeros(g.size * g.longest, *x.shape[1:]).index_copy(0, g.slots, x[g.rows])
    return flat.view(g.size, g.longest, *x.shape[1:]).transpose(1, 2)


def one_width(q, k, v):
    """(q, k, v, d_v) with q, k, v zero-padded to one head width, which the fused kernels need:
    values narrower than the queries (multi-latent attention: 192 / 128) get zero columns, which
    only add zero output columns (cut back to d_v); wider values pad q and k instead, which adds 0
    to every score (the kernels take the scale explicitly)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return q, k, v, dv


def sdpa_attention(q, k, v, scale: float, groups: list[PaddedGroup], inverse: torch.Tensor) -> torch.Tensor:
    """Causal attention of a packed row (CP = 1) as one `scaled_dot_product_attention` call per
    group of `padded_groups`. q [t, h, d], k [t, g, d], v [t, g, d_v]; returns [t, h, d_v].

    Values of another width than the queries (multi-latent attention) go through `one_width`: SDPA's
    fused kernels take one head width, and its math fallback builds its causal mask on the host."""
    if q.shape[-1] != v.shape[-1]:
        q, k, v, dv = one_width(q, k, v)
        return sdpa_attention(q, k, v, scale, groups, inverse)[..., :dv]
    h, g = q.shape[1], k.shape[1]
    if q.is_cuda and h != g:  # keep CUDA's fp32 (memory-efficient) kernel, which takes no GQA
        k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    outs = []
    for grp in groups:
        o = F.scaled_dot_product_attention(_to_padded(q, grp), _to_padded(k, grp), _to_padded(v, grp),
                                           is_causal=True, scale=scale, enable_gqa=k.shape[1] != h)
        outs.append(o.transpose(1, 2).reshape(grp.size * grp.longest, h, -1)[grp.slots])
    if not outs:
        return q.new_zeros(q.shape[0], h, v.shape[-1])
    return torch.cat(outs)[inverse]


# ---- varlen: torch's FlashAttention kernel -----------------------------------------------------

@dataclass
class VarlenSegments:
    """Arguments of one varlen call: query / key segment boundaries (host lists and int32 device
    tensors), their longest lengths, and (CP) the rows of the gathered keys each key segment reads."""

    cu_q: list[int]
    cu_k: list[int]
    cu_q_dev: torch.Tensor
    cu_k_dev: torch.Tensor
    max_q: int
    max_k: int
    key_rows: torch.Tensor | None = None


def _longest(cu: list[int]) -> int:
    return max((e - s for s, e in zip(cu[:-1], cu[1:])), default=0)


def self_segments(cu_seqlens: list[int], cu_dev: torch.Tensor | None = None, device=None) -> VarlenSegments:
    """CP = 1: every sequence is one query segment and its own key segment."""
    if cu_dev is None:
        cu_dev = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    n = _longest(cu_seqlens)
    return VarlenSegments(cu_seqlens, cu_seqlens, cu_dev, cu_dev, n, n)


def cp_prefix_segments(cu_seqlens: list[int], cp_size: int, cp_rank: int, device=None) -> VarlenSegments:
    """CP rank `cp_rank`'s queries (chunks r and 2*CP-1-r of every sequence, in the order of
    `cp_shard_index`) as segments, each over the keys of its sequence from the start to the
    chunk's own end. The causal mask aligned to the bottom right (query i of a chunk sees key j
    <= i + len_k - len_q) is then exactly the sequence's causal mask."""
    cu_q, cu_k, rows = [0], [0], []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if (e - s) % (2 * cp_size):
            raise ValueError(f"sequence length {e - s} is not a multiple of 2*cp = {2 * cp_size}")
        c = (e - s) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            end = s + (chunk + 1) * c
            cu_q.append(cu_q[-1] + c)
            cu_k.append(cu_k[-1] + end - s)
            rows.append(torch.arange(s, end))
    key_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return VarlenSegments(cu_q, cu_k, torch.tensor(cu_q, dtype=torch.int32, device=device),
                          torch.tensor(cu_k, dtype=torch.int32, device=device), _longest(cu_q), _longest(cu_k),
                          key_rows.to(device))


def varlen_kwargs(parameters, heads: int, groups: int, scale: float, head_dim: int) -> tuple[dict, bool]:
    """Keyword arguments for this torch's `varlen_attn` (its signature's `parameters`) and
    whether K/V must be repeated to the query heads first. torch 2.10 takes `is_causal`, 2.11 on
    `window_size=(-1, 0)`; `enable_gqa` and `scale` exist only in newer releases (without
    `scale` the kernel uses 1/sqrt(d), so any other scale is refused)."""
    kwargs: dict = {}
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in parameters:
        kwargs["is_causal"] = True
    else:
        raise RuntimeError("torch's varlen_attn takes neither window_size nor is_causal: causal masking unknown")
    if "scale" in parameters:
        kwargs["scale"] = scale
    elif abs(scale - head_dim ** -0.5) > 1e-12 * scale:
        raise RuntimeError(f"this torch's varlen_attn has no scale argument and the model's softmax scale "
                           f"{scale} is not 1/sqrt({head_dim})")
    repeat = heads != groups and "enable_gqa" not in parameters
    if heads != groups and not repeat:
        kwargs["enable_gqa"] = True
    return kwargs, repeat


def check_varlen_inputs(q, k, v, seg: VarlenSegments) -> None:
    """The FlashAttention varlen kernel's input contract, asserted before the call (so a CPU test
    of the argument building fails where the GPU kernel would)."""
    if q.dtype not in VARLEN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"varlen attention takes bf16/fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen attention takes [tokens, heads, dim] tensors, got {q.shape}, {k.shape}, {v.shape}")
    d = q.shape[-1]
    if d % 8 or d > VARLEN_MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"varlen attention needs one head dim, a multiple of 8 and <= {VARLEN_MAX_HEAD_DIM}: "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of the key/value heads {k.shape[1]}")
    for name, cu, dev, n, longest in (("q", seg.cu_q, seg.cu_q_dev, q.shape[0], seg.max_q),
                                       ("k", seg.cu_k, seg.cu_k_dev, k.shape[0], seg.max_k)):
        if dev.dtype != torch.int32 or dev.device != q.device or dev.numel() != len(cu):
            raise ValueError(f"cu_seq_{name} must be int32 on {q.device} with {len(cu)} entries, got {dev.dtype} "
                             f"on {dev.device} with {dev.numel()}")
        if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seq_{name} must rise from 0 to {n} tokens, got {cu[:4]}...{cu[-1]}")
        if longest != _longest(cu):
            raise ValueError(f"max_{name}={longest} is not the longest segment {_longest(cu)}")
    if len(seg.cu_q) != len(seg.cu_k):
        raise ValueError("query and key segments must pair up")
    if any(qe - qs > ke - ks for qs, qe, ks, ke in zip(seg.cu_q[:-1], seg.cu_q[1:], seg.cu_k[:-1], seg.cu_k[1:])):
        raise ValueError("a query segment is longer than its key segment (bottom-right causal would hide keys)")


def varlen_attention(q, k, v, scale: float, seg: VarlenSegments, fn=None) -> torch.Tensor:
    """Causal attention through torch's varlen kernel. q [t_q, h, d]; k [t, g, d], v [t, g, d_v],
    read through `seg.key_rows` when given (CP: the gathered keys in sequence order).

    The kernel takes one head width: other value widths go through `one_width`."""
    fn = fn or varlen_function()
    if seg.key_rows is not None:
        k, v = k[seg.key_rows], v[seg.key_rows]
    if q.shape[-1] != v.shape[-1]:
        q, k, v, dv = one_width(q, k, v)
        return varlen_attention(q, k, v, scale, VarlenSegments(seg.cu_q, seg.cu_k, seg.cu_q_dev, seg.cu_k_dev,
                                                               seg.max_q, seg.max_k), fn)[..., :dv]
    kwargs, repeat = varlen_kwargs(inspect.signature(fn).parameters, q.shape[1], k.shape[1], scale, q.shape[-1])
    if repeat:
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1), v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    check_varlen_inputs(q, k, v, seg)
    return fn(q, k, v, seg.cu_q_dev, seg.cu_k_dev, seg.max_q, seg.max_k, **kwargs)
