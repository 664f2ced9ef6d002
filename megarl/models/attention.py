"""megarl's local core attention: packed variable-length sequences, context parallelism, and memory
linear in the sequence length, on any device (CPU with gloo, GPU with NCCL).

It replaces megatron's `DotProductAttention` in the local layer spec. megatron's module builds a
[b, heads, s, s] score tensor for the whole row and refuses both packed sequences and CP; this one

- takes THD inputs (`packed_seq_params.qkv_format == "thd"`, sequences delimited by
  `cu_seqlens_q`, each padded to a multiple of 2*CP) and, for megatron's BSHD calls, each batch row
  as one causal sequence;
- under CP, each rank holds chunks r and 2*CP-1-r of every sequence (load balancing, as in
  megatron/TE: `cp_shard_index`). K and V are all-gathered over the CP group and put back in
  sequence order; the backward reduce-scatters dK/dV to the ranks that own those tokens;
- computes attention block by block over the queries (`blockwise_attention`): the forward keeps
  only the output and the log-sum-exp, the backward recomputes each block's probabilities (the
  FlashAttention recurrences, in plain torch), so no [s, s] tensor ever exists.

RoPE needs nothing from here: megatron applies it per sequence and per CP chunk from the same
`cu_seqlens` (`rope_utils._apply_rotary_pos_emb_thd`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

SCORE_BLOCK_BYTES = 32 << 20  # float32 scores of one query block: heads x block x keys x 4 bytes


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


def _block_scores(q, k, scale, q_seq, q_pos, k_seq, k_pos):
    """Masked scores [g, r, nq, nk] (float32) of queries q [nq, g, r, d] against keys k [nk, g, d]:
    a query sees the keys of its own sequence at positions <= its own."""
    s = torch.einsum("qgrd,kgd->grqk", q.float(), k.float()) * scale
    visible = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return s.masked_fill(~visible, float("-inf"))


def _key_ranges(q_seq, q_pos, k_seq, block):
    """[(a, b, lo, hi)]: for the query block [a, b), the keys [lo, hi) that can be visible. Queries
    and keys are in sequence order, so that is from the start of the first query's sequence to the
    last query's own position."""
    nq = q_seq.numel()
    if nq == 0:
        return []
    starts = torch.searchsorted(k_seq, torch.arange(int(k_seq[-1]) + 1, device=k_seq.device))
    a = torch.arange(0, nq, block, device=q_seq.device)
    b = torch.clamp(a + block, max=nq)
    lo = starts[q_seq[a]]
    hi = starts[q_seq[b - 1]] + q_pos[b - 1] + 1
    return list(zip(a.tolist(), b.tolist(), lo.tolist(), hi.tolist()))


class _BlockwiseAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v with the FlashAttention forward/backward recurrences:

        forward (per query block):  S = q k^T * scale (masked), lse = logsumexp(S), O = exp(S - lse) v
        backward (per query block): P = exp(S - lse), dV += P^T dO, dP = dO v^T,
                                    dS = P * (dP - rowsum(dO * O)), dq = dS k * scale, dK += dS^T q * scale

    q: [nq, h, d], k, v: [nk, g, d] (h a multiple of g: grouped-query attention without copying
    K/V); output [nq, h, d] in q's dtype. Only q, k, v, the output and lse are saved.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, q_seq, q_pos, k_seq, k_pos, block):
        nq, h, d = q.shape
        g = k.shape[1]
        qg = q.view(nq, g, h // g, d)
        out = q.new_empty(nq, g, h // g, v.shape[-1], dtype=torch.float32)
        lse = q.new_empty(g, h // g, nq, dtype=torch.float32)
        ranges = _key_ranges(q_seq, q_pos, k_seq, block)
        for a, b, lo, hi in ranges:
            s = _block_scores(qg[a:b], k[lo:hi], scale, q_seq[a:b], q_pos[a:b], k_seq[lo:hi], k_pos[lo:hi])
            blk_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - blk_lse[..., None])
            out[a:b] = torch.einsum("grqk,kgd->qgrd", p, v[lo:hi].float())
            lse[..., a:b] = blk_lse
        ctx.save_for_backward(q, k, v, out, lse, q_seq, q_pos, k_seq, k_pos)
        ctx.scale, ctx.ranges = scale, ranges
        return out.view(nq, h, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_seq, q_pos, k_seq, k_pos = ctx.saved_tensors
        nq, h, d = q.shape
        g = k.shape[1]
        qg = q.view(nq, g, h // g, d)
        do = grad_out.reshape(nq, g, h // g, -1).float()
        delta = (do * out).sum(-1)  # [nq, g, r] = rowsum(dO * O)
        dq = q.new_zeros(nq, g, h // g, d, dtype=torch.float32)
        dk = k.new_zeros(k.shape, dtype=torch.float32)
        dv = v.new_zeros(v.shape, dtype=torch.float32)
        for a, b, lo, hi in ctx.ranges:
            s = _block_scores(qg[a:b], k[lo:hi], ctx.scale, q_seq[a:b], q_pos[a:b], k_seq[lo:hi], k_pos[lo:hi])
            p = torch.exp(s - lse[..., a:b, None])  # [g, r, nq, nk]
            dv[lo:hi] += torch.einsum("grqk,qgrd->kgd", p, do[a:b])
            dp = torch.einsum("qgrd,kgd->grqk", do[a:b], v[lo:hi].float())
            ds = p * (dp - delta[a:b].permute(1, 2, 0)[..., None])
            dq[a:b] = torch.einsum("grqk,kgd->qgrd", ds, k[lo:hi].float()) * ctx.scale
            dk[lo:hi] += torch.einsum("grqk,qgrd->kgd", ds, qg[a:b].float()) * ctx.scale
        return (dq.view(nq, h, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None)


def query_block_size(heads: int, n_queries: int, n_keys: int, longest: int, on_gpu: bool = True) -> int:
    """Queries per block: 16 to 512, at most max(64, longest) (a block's keys span its sequences,
    so a long block over short sequences computes mostly masked scores), and one block's float32
    scores, heads x block x key span x 4 bytes, near SCORE_BLOCK_BYTES.

    On GPU the key span is what a block can reach: the longest sequence plus the keys of its own
    queries; under CP (n_keys = CP x n_queries) a block that crosses into the next sequence can
    also start at its first local chunk, past keys it holds no queries for: twice the longest plus
    512 x CP. Sizing by the whole packed row made the number of blocks grow with the square of the
    row's length and the pass launch-bound (0.5b shape, 16k-token rows of 2k sequences, H100:
    36-query blocks, 21 s per step against 1.7 s at 4k tokens).
    On CPU the span is the whole row, as before: the smaller blocks keep the scores in cache, which
    is faster there (8 x 1k-token sequences, 14 heads, forward + backward: 73-query blocks 1.8x
    faster than 390), and keeps CPU results bit-identical to earlier releases."""
    cp = max(1, n_keys // max(1, n_queries))
    span = min(n_keys, (1 if cp == 1 else 2) * longest + 512 * cp) if on_gpu else n_keys
    return max(16, min(512, max(64, longest), SCORE_BLOCK_BYTES // (4 * heads * max(1, span))))


def blockwise_attention(q, k, v, scale, q_seq, q_pos, k_seq, k_pos, block: int | None = None):
    """Causal attention of queries q [nq, h, d] at (sequence, position) (q_seq, q_pos) over keys /
    values k, v [nk, g, d] at (k_seq, k_pos), keys in sequence order. Memory O(block * key span);
    the default block is `query_block_size`."""
    if block is None:
        longest = int(k_pos.max()) + 1 if k_pos.numel() else 1
        block = query_block_size(q.shape[1], q.shape[0], k.shape[0], longest, on_gpu=q.is_cuda)
    return _BlockwiseAttention.apply(q, k, v, scale, q_seq, q_pos, k_seq, k_pos, block)


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

    Constructed by megatron's `SelfAttention` with the `DotProductAttention` keyword arguments;
    dropout on attention probabilities is not supported (every supported model has 0).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise ValueError(f"megarl's local attention has no attention dropout (attention_dropout={p}); "
                             "use model.transformer_impl=transformer_engine or a model with attention_dropout 0")
        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
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
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
            out = self._thd(query, key, value, cu)
            return out.reshape(out.shape[0], -1)
        if self.cp_size > 1:
            raise ValueError("context parallelism needs packed (THD) inputs: pass packed_seq_params")
        s, b = query.shape[:2]  # BSHD: every batch row is one causal sequence
        flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
        out = self._thd(*flat, [i * s for i in range(b + 1)])
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _thd(self, q, k, v, cu_seqlens: list[int]):
        """q, k, v: this rank's tokens of the packed row (the full row when CP = 1)."""
        seq, pos = sequence_coords(cu_seqlens, device=q.device)
        if self.cp_size == 1:
            return blockwise_attention(q, k, v, self.scale, seq, pos, seq, pos)
        order = torch.cat([cp_shard_index(cu_seqlens, self.cp_size, r) for r in range(self.cp_size)]).to(q.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        k_full = gather_from_cp(k, self.cp_group)[inverse]  # back to sequence order
        v_full = gather_from_cp(v, self.cp_group)[inverse]
        mine = cp_shard_index(cu_seqlens, self.cp_size, self.cp_rank).to(q.device)
        return blockwise_attention(q, k_full, v_full, self.scale, seq[mine], pos[mine], seq, pos)
