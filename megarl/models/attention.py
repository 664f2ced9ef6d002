"""megarl's local core attention: packed variable-length sequences and context parallelism on any
device (CPU with gloo, GPU with NCCL), with the fastest kernel each place has.

It replaces megatron's `DotProductAttention` in the local layer spec. megatron's module builds a
[b, heads, s, s] score tensor for the whole row and refuses both packed sequences and CP; this one

- takes THD inputs (`packed_seq_params.qkv_format == "thd"`, sequences delimited by
  `cu_seqlens_q`, each padded to a multiple of 2*CP) and, for megatron's BSHD calls, each batch row
  as one causal sequence;
- under CP, each rank holds chunks r and 2*CP-1-r of every sequence (load balancing, as in
  megatron/TE: `cp_shard_index`). K and V are all-gathered over the CP group and put back in
  sequence order; the backward reduce-scatters dK/dV to the ranks that own those tokens;
- runs one of three kernels (`megarl.models.attention_kernels`): torch's FlashAttention varlen
  kernel on CUDA in bf16/fp16 (CP included), `scaled_dot_product_attention` on padded groups of
  similar length elsewhere at CP = 1, and the plain-torch blockwise recurrences
  (`megarl.models.attention_blockwise`) for CP on CPU or fp32.

`thd_params` builds the `PackedSeqParams` of a packed row once per micro-batch with host copies
of its boundaries, so the layers derive their kernel arguments once and never read them back from
the GPU. RoPE needs nothing from here: megatron applies it per sequence and per CP chunk from the
same `cu_seqlens` (`rope_utils._apply_rotary_pos_emb_thd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megarl.models import attention_kernels as kernels
from megarl.models.attention_blockwise import blockwise_attention


def cp_shard_index(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a packed row held by CP rank `cp_rank`: for every sequence [s, e) (length a
    multiple of 2*cp_size, chunk c = (e - s) / (2*cp_size)), chunk r then chunk 2*cp_size-1-r."""
    parts = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if (e - s) % (2 * cp_size):
            raise ValueError(f"sequence length {e - s} is not a multiple of 2*cp = {2 * cp_size}")
        c = (e - s) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(s + chunk * c, s + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def sequence_coords(cu_seqlens: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, position within the sequence) of every token of a packed row."""
    lengths = torch.tensor([e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])], device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    starts = torch.tensor(cu_seqlens[:-1], device=device, dtype=torch.long)
    pos = torch.arange(int(cu_seqlens[-1]), device=device) - starts[seq]
    return seq, pos


@dataclass
class PackedRow(PackedSeqParams):
    """megatron's `PackedSeqParams` of one packed row plus the host copy of its boundaries and a
    cache of what the attention layers derive from them (shared by every layer of a forward and
    its backward)."""

    cu_host: tuple[int, ...] = ()
    cache: dict = field(default_factory=dict, repr=False, compare=False)


def thd_params(cu_seqlens: torch.Tensor | list[int], device=None, rope_on_host: bool = False) -> PackedRow:
    """THD `PackedSeqParams` for padded sequence boundaries `cu_seqlens` (host list or tensor; the
    int32 copy megatron reads goes to `device`, default the tensor's own device).

    rope_on_host (models whose every core attention is `LocalAttention`): the "padded" boundaries
    megatron's attention hands to its unfused THD RoPE are a host copy. That RoPE reads them back
    with `.tolist()` for q and for k in every layer, which on a GPU is a device sync each time
    (56 per forward of a 28-layer model, the CPU never more than a layer ahead of the GPU). TE's
    attention reads those boundaries too and needs them on the device: leave it off for TE."""
    if isinstance(cu_seqlens, torch.Tensor):
        host = cu_seqlens.tolist()
        device = cu_seqlens.device if device is None else device
    else:
        host = list(cu_seqlens)
    cu = torch.tensor(host, dtype=torch.int32, device=device)
    on_host = torch.tensor(host, dtype=torch.int32) if rope_on_host else None
    longest = max((b - a for a, b in zip(host[:-1], host[1:])), default=0)
    return PackedRow(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=on_host,
                     cu_seqlens_kv_padded=on_host, max_seqlen_q=longest, max_seqlen_kv=longest, cu_host=tuple(host))


def runs_local_attention(model) -> bool:
    """Whether every core attention of a model (chunk, possibly wrapped) is megarl's LocalAttention."""
    found = [m for m in model.modules() if isinstance(m, LocalAttention)]
    cores = [m for m in model.modules() if hasattr(m, "core_attention")]
    return bool(found) and len(found) == len(cores)


def _row_boundaries(params) -> tuple[list[int], torch.Tensor, dict]:
    """(host boundaries, int32 device boundaries, cache) of THD params from `thd_params` or from
    elsewhere (then read back once and not cached). In megarl's rows every sequence already
    includes its padding, so `cu_seqlens_q` is the padded boundaries."""
    if isinstance(params, PackedRow) and params.cu_host:
        return list(params.cu_host), params.cu_seqlens_q, params.cache
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return cu.tolist(), cu, {}


def _cached(cache: dict, key, make):
    if key not in cache:
        cache[key] = make()
    return cache[key]


class _GatherFromCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group (rank order); the backward sums the gradients of
    all ranks and returns this rank's slice (reduce-scatter: dK/dV go back to their owners)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty(grad.shape[0] // world, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter of tensors
        return grad.chunk(world)[dist.get_rank(ctx.group)].clone(), None


def gather_from_cp(x: torch.Tensor, group) -> torch.Tensor:
    """[t_local, ...] of every CP rank, concatenated in rank order; dK/dV-style backward."""
    return _GatherFromCP.apply(x, group)


class LocalAttention(torch.nn.Module):
    """Core attention for megatron's local layer spec (see the module docstring).

    Constructed by megatron's `SelfAttention` with the `DotProductAttention` keyword arguments
    (multi-latent attention adds k_channels / v_channels: queries and keys of one width, values of
    another, which every kernel takes); dropout on attention probabilities is not supported (every
    supported model has 0).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__()
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise ValueError(f"megarl's local attention has no attention dropout (attention_dropout={p}); "
                             "use model.transformer_impl=transformer_engine or a model with attention_dropout 0")
        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None:
            from megatron.core import parallel_state as ps

            self.cp_group = ps.get_context_parallel_group()
        self.cp_size = dist.get_world_size(self.cp_group)
        self.cp_rank = dist.get_rank(self.cp_group)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("megarl's local attention takes no attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._thd(query, key, value, packed_seq_params)
            return out.reshape(out.shape[0], -1)
        if self.cp_size > 1:
            raise ValueError("context parallelism needs packed (THD) inputs: pass packed_seq_params")
        s, b = query.shape[:2]  # BSHD: every batch row is one causal sequence
        flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
        out = self._thd(*flat, thd_params([i * s for i in range(b + 1)], device=query.device))
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _thd(self, q, k, v, params):
        """q, k, v: this rank's tokens of the packed row (the full row when CP = 1)."""
        cu, cu_dev, cache = _row_boundaries(params)
        kernel = kernels.select_kernel(q.device.type, q.dtype, self.cp_size)
        if self.cp_size == 1:
            if kernel == "varlen":
                seg = _cached(cache, "varlen", lambda: kernels.self_segments(cu, cu_dev))
                return kernels.varlen_attention(q, k, v, self.scale, seg)
            if kernel == "sdpa":
                groups, inverse = _cached(cache, "sdpa", lambda: kernels.padded_groups(cu, q.device))
                return kernels.sdpa_attention(q, k, v, self.scale, groups, inverse)
            seq, pos = _cached(cache, "coords", lambda: sequence_coords(cu, device=q.device))
            return blockwise_attention(q, k, v, self.scale, seq, pos, seq, pos)
        inverse = _cached(cache, "cp_inverse", lambda: _cp_gather_inverse(cu, self.cp_size, q.device))
        k_full = gather_from_cp(k, self.cp_group)[inverse]  # back to sequence order
        v_full = gather_from_cp(v, self.cp_group)[inverse]
        if kernel == "varlen":
            seg = _cached(cache, ("cp_varlen", self.cp_rank),
                          lambda: kernels.cp_prefix_segments(cu, self.cp_size, self.cp_rank, q.device))
            return kernels.varlen_attention(q, k_full, v_full, self.scale, seg)
        seq, pos = _cached(cache, "coords", lambda: sequence_coords(cu, device=q.device))
        mine = _cached(cache, ("cp_mine", self.cp_rank),
                       lambda: cp_shard_index(cu, self.cp_size, self.cp_rank).to(q.device))
        return blockwise_attention(q, k_full, v_full, self.scale, seq[mine], pos[mine], seq, pos)


def _cp_gather_inverse(cu: list[int], cp_size: int, device) -> torch.Tensor:
    """The permutation that puts the CP ranks' gathered tokens (rank order) back in sequence order."""
    order = torch.cat([cp_shard_index(cu, cp_size, r) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse.to(device)
