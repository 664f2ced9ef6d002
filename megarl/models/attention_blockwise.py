"""Causal attention over a packed row, query block by query block, in plain torch: the
FlashAttention forward / backward recurrences without a fused kernel, on any device and dtype.

Queries and keys carry their (sequence, position) coordinates, so the same function serves a
whole packed row (CP = 1) and a context-parallel rank's query chunks over the gathered keys. The
forward keeps only the output and the log-sum-exp; the backward recomputes each block's
probabilities, so no [s, s] tensor ever exists. It is the reference the faster kernels of
`megarl.models.attention_kernels` are checked against, and their fallback.
"""

from __future__ import annotations

import torch

SCORE_BLOCK_BYTES = 32 << 20  # float32 scores of one query block: heads x block x keys x 4 bytes


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
