"""megarl.models.attention against a dense reference: softmax(q k^T * scale + block-causal mask) v
built as one [h, s, s] matrix in float64, forward and gradients."""

import math

import pytest
import torch

from megarl.models.attention import (SCORE_BLOCK_BYTES, _key_ranges, blockwise_attention, cp_shard_index,
                                    query_block_size, sequence_coords)


def dense_attention(q, k, v, scale, cu):
    """The textbook formula over the whole packed row, float64."""
    seq, pos = sequence_coords(cu)
    g = k.shape[1]
    rep = q.shape[1] // g
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    visible = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.double())


@pytest.mark.parametrize("lengths,heads,groups,block", [
    ([7], 4, 4, 3),            # one sequence, MHA, blocks smaller than the sequence
    ([5, 11, 1, 9], 6, 2, 4),  # packed, GQA, a one-token sequence, blocks crossing sequences
    ([33, 2], 2, 1, 512),      # MQA, one block for everything
])
def test_blockwise_equals_dense_forward_and_backward(lengths, heads, groups, block):
    torch.manual_seed(0)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t, d = cu[-1], 8
    q = torch.randn(t, heads, d, requires_grad=True)
    k = torch.randn(t, groups, d, requires_grad=True)
    v = torch.randn(t, groups, d, requires_grad=True)
    scale = 1 / math.sqrt(d)
    seq, pos = sequence_coords(cu)
    out = blockwise_attention(q, k, v, scale, seq, pos, seq, pos, block=block)
    ref = dense_attention(q, k, v, scale, cu)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g.double(), r.double(), atol=1e-5)


def test_queries_on_a_subset_see_the_full_keys():
    """What one CP rank computes: its load-balanced chunks of the queries over all keys equal the
    same rows of the full attention."""
    torch.manual_seed(1)
    cu, cp = [0, 8, 20], 2
    q, k, v = torch.randn(20, 2, 4), torch.randn(20, 2, 4), torch.randn(20, 2, 4)
    seq, pos = sequence_coords(cu)
    ref = dense_attention(q, k, v, 0.5, cu)
    for r in range(cp):
        mine = cp_shard_index(cu, cp, r)
        out = blockwise_attention(q[mine], k, v, 0.5, seq[mine], pos[mine], seq, pos, block=3)
        assert torch.allclose(out.double(), ref[mine], atol=1e-6)


def test_cp_shard_index_is_the_load_balanced_chunking():
    # sequence of 8 at cp=2 -> chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_shard_index([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_index([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_shard_index([0, 4, 8], 2, 1).tolist() == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        cp_shard_index([0, 6], 2, 0)


def test_query_block_is_sized_by_the_key_span_not_the_packed_row():
    # Qwen2.5-0.5B's 14 heads, a 16k-token row of 2k-token sequences: 32 MiB / (4 B x 14 x (2048 + 512))
    assert query_block_size(14, 16384, 16384, 2048) == 33554432 // (4 * 14 * 2560) == 234
    # one 16k sequence at CP=2 (8k local queries over 16k gathered keys): the row is the span
    assert query_block_size(14, 8192, 16384, 16384) == 33554432 // (4 * 14 * 16384) == 36
    assert query_block_size(2, 100, 100, 7) == 64  # short sequences: at most max(64, longest)
    assert query_block_size(64, 10**6, 10**6, 10**6) == 16  # never under 16
    # CPU: sized by the whole row (cache-sized blocks), the formula of earlier releases
    assert query_block_size(14, 16384, 16384, 2048, on_gpu=False) == 33554432 // (4 * 14 * 16384) == 36


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_block_stays_inside_the_span_it_was_sized_for(cp):
    """The bound query_block_size assumes: a block's keys run at most longest + block (CP=1), or
    2 x longest + block x CP."""
    g = torch.Generator().manual_seed(cp)
    for _ in range(20):
        lengths = (torch.randint(1, 400, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g) * 2 * cp).tolist()
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seq, pos = sequence_coords(cu)
        mine = torch.cat([cp_shard_index(cu, cp, r) for r in range(cp)])[: cu[-1] // cp] if cp > 1 else torch.arange(cu[-1])
        for block in (16, 100, 512):
            spans = [hi - lo for _, _, lo, hi in _key_ranges(seq[mine], pos[mine], seq, block)]
            assert max(spans) <= (1 if cp == 1 else 2) * max(lengths) + block * cp
    assert SCORE_BLOCK_BYTES == 32 << 20
