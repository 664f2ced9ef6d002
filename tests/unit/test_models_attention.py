"""megarl.models.attention against a dense reference: softmax(q k^T * scale + block-causal mask) v
built as one [h, s, s] matrix in float64, forward and gradients."""

import inspect
import math

import pytest
import torch

from megarl.models import attention_kernels as kernels
from megarl.models.attention import cp_shard_index, sequence_coords
from megarl.models.attention_blockwise import SCORE_BLOCK_BYTES, _key_ranges, blockwise_attention, query_block_size


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


# ---- the faster kernels (megarl.models.attention_kernels) against the blockwise reference ----

def _packed(lengths, heads, groups, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = cu[-1]
    mk = lambda h: torch.randn(t, h, d, generator=g, dtype=torch.float32).to(dtype).requires_grad_(True)
    return cu, mk(heads), mk(groups), mk(groups)


@pytest.mark.parametrize("lengths,heads,groups", [
    ([7], 4, 4),
    ([5, 11, 1, 9, 64, 3, 3], 6, 2),        # GQA, one-token sequences, several length groups
    ([90, 61, 75, 110, 60, 88, 99], 2, 1),  # the quickstart's shape: one padded group
])
def test_sdpa_groups_equal_blockwise_within_1e_6(lengths, heads, groups):
    cu, q, k, v = _packed(lengths, heads, groups)
    seq, pos = sequence_coords(cu)
    ref = blockwise_attention(q, k, v, 0.3, seq, pos, seq, pos)
    grps, inverse = kernels.padded_groups(cu)
    out = kernels.sdpa_attention(q, k, v, 0.3, grps, inverse)
    assert (out - ref).abs().max() < 1e-6
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-6 * max(1.0, b.abs().max().item())


def test_length_groups_cover_every_sequence_once_within_the_padding_bound():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        lengths = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        groups = kernels.length_groups(lengths)
        flat = sorted(i for grp in groups for i in grp)
        assert flat == [i for i, n in enumerate(lengths) if n > 0]
        for grp in groups:
            assert len(grp) * max(lengths[i] for i in grp) <= kernels.SDPA_MAX_PADDING * sum(lengths[i] for i in grp)
    assert kernels.length_groups([100, 1, 98, 0, 2, 3]) == [[0, 2, 5, 4], [1]]  # 5 x 100 > 2 x 204


@pytest.mark.parametrize("device,dtype,cp,has_varlen,expected", [
    ("cuda", torch.bfloat16, 1, True, "varlen"),
    ("cuda", torch.float16, 2, True, "varlen"),
    ("cuda", torch.float32, 1, True, "sdpa"),      # flash kernels take no fp32
    ("cuda", torch.float32, 2, True, "blockwise"),
    ("cuda", torch.bfloat16, 1, False, "sdpa"),    # a torch without the varlen module
    ("cpu", torch.bfloat16, 1, True, "sdpa"),
    ("cpu", torch.float32, 2, True, "blockwise"),
])
def test_kernel_selection(device, dtype, cp, has_varlen, expected):
    assert kernels.select_kernel(device, dtype, cp, has_varlen=has_varlen, cuda_runtime=True) == expected


def test_strict_device_tensors_are_not_a_gpu():
    """The CPU runtime's strict device mode tags host tensors "cuda": they get the host kernels."""
    assert kernels.select_kernel("cuda", torch.bfloat16, 1, has_varlen=True, cuda_runtime=False) == "sdpa"
    assert kernels.select_kernel("cuda", torch.bfloat16, 2, has_varlen=True, cuda_runtime=False) == "blockwise"


def test_a_forced_kernel_that_cannot_run_here_is_refused():
    with pytest.raises(ValueError, match="varlen.*needs CUDA"):
        kernels.select_kernel("cpu", torch.bfloat16, 1, forced="varlen", has_varlen=True, cuda_runtime=True)
    with pytest.raises(ValueError, match="cp=1"):
        kernels.select_kernel("cpu", torch.float32, 2, forced="sdpa")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        with kernels.forced_kernel("flash"):
            pass
    with kernels.forced_kernel("blockwise"):
        assert kernels.select_kernel("cuda", torch.bfloat16, 1, has_varlen=True, cuda_runtime=True) == "blockwise"
    assert kernels.select_kernel("cuda", torch.bfloat16, 1, has_varlen=True, cuda_runtime=True) == "varlen"


def test_varlen_arguments_for_each_torch_signature():
    d = 64
    scale = d ** -0.5
    # torch 2.10: is_causal, no scale / enable_gqa -> K/V repeated, default scale only
    kw, rep = kernels.varlen_kwargs({"is_causal": None}, 14, 2, scale, d)
    assert kw == {"is_causal": True} and rep
    with pytest.raises(RuntimeError, match="no scale argument"):
        kernels.varlen_kwargs({"is_causal": None}, 14, 2, 0.5, d)
    # torch 2.11-style window_size with scale but no GQA flag
    kw, rep = kernels.varlen_kwargs({"window_size": None, "scale": None}, 14, 2, 0.5, d)
    assert kw == {"window_size": (-1, 0), "scale": 0.5} and rep
    # torch 2.13 (this machine's): everything
    params = inspect.signature(kernels.varlen_function()).parameters
    kw, rep = kernels.varlen_kwargs(params, 14, 2, 0.5, d)
    assert kw == {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True} and not rep
    kw, rep = kernels.varlen_kwargs(params, 4, 4, 0.5, d)
    assert kw == {"window_size": (-1, 0), "scale": 0.5} and not rep


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None,
                     enable_gqa=False, **_):
    """torch's documented varlen_attn semantics in float64: per segment, the causal mask aligned to
    the bottom right (query i sees key j <= i + len_k - len_q); GQA head n reads group n // (h/g)."""
    assert window_size == (-1, 0)
    h, g = query.shape[1], key.shape[1]
    assert enable_gqa or h == g
    out = torch.zeros(query.shape, dtype=torch.float64)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    for qs, qe, ks, ke in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        q = query[qs:qe].double()
        k = key[ks:ke].double().repeat_interleave(h // g, dim=1)
        v = value[ks:ke].double().repeat_interleave(h // g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        i, j = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
        p = torch.softmax(s.masked_fill(j > i + (ke - ks) - (qe - qs), float("-inf")), dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, v)
    return out


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_varlen_arguments_give_each_cp_rank_its_rows_of_the_full_attention(cp):
    """The segments built for a CP rank (chunks r and 2*CP-1-r over their prefixes), passed with
    the arguments varlen_attention builds, give exactly that rank's rows of the attention over the
    whole row; checked with a float64 stand-in for the kernel with its documented semantics."""
    lengths = [2 * cp * n for n in (3, 1, 5, 2)]
    cu, q, k, v = _packed(lengths, 6, 2, d=16, dtype=torch.bfloat16, seed=cp)
    ref = dense_attention(q, k, v, 0.25, cu)
    for r in range(cp):
        mine = cp_shard_index(cu, cp, r) if cp > 1 else torch.arange(cu[-1])
        seg = kernels.cp_prefix_segments(cu, cp, r) if cp > 1 else kernels.self_segments(cu)
        out = kernels.varlen_attention(q[mine], k, v, 0.25, seg, fn=reference_varlen)
        assert torch.allclose(out, ref[mine], atol=1e-12)


def test_varlen_input_contract():
    cu = [0, 16, 48]
    seg = kernels.self_segments(cu)
    ok = lambda h, d=64, dtype=torch.bfloat16: torch.zeros(48, h, d, dtype=dtype)
    kernels.check_varlen_inputs(ok(14), ok(2), ok(2), seg)
    with pytest.raises(TypeError, match="bf16/fp16"):
        kernels.check_varlen_inputs(ok(14, dtype=torch.float32), ok(2), ok(2), seg)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.check_varlen_inputs(ok(14, 12), ok(2, 12), ok(2, 12), seg)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        kernels.check_varlen_inputs(ok(14), ok(3), ok(3), seg)
    with pytest.raises(ValueError, match="must be int32"):
        kernels.check_varlen_inputs(ok(14), ok(2), ok(2), kernels.VarlenSegments(
            cu, cu, torch.tensor(cu), torch.tensor(cu, dtype=torch.int32), 32, 32))
    with pytest.raises(ValueError, match="rise from 0 to 48"):
        kernels.check_varlen_inputs(ok(14), ok(2), ok(2), kernels.self_segments([0, 16, 40]))
    with pytest.raises(ValueError, match="max_q=16 is not the longest"):
        kernels.check_varlen_inputs(ok(14), ok(2), ok(2), kernels.VarlenSegments(
            cu, cu, seg.cu_q_dev, seg.cu_k_dev, 16, 32))
