"""megarl's local attention kernels with values of another width than queries and keys (multi-latent
attention: q, k of qk_nope + qk_rope, v of v_head_dim), against the dense float64 reference:
blockwise and SDPA forward and backward, and the varlen kernel's zero padding (through the
documented-semantics stand-in of tests/unit/test_models_attention.py)."""

import pytest
import torch

from megarl.models import attention_kernels as kernels
from megarl.models.attention import cp_shard_index, sequence_coords
from megarl.models.attention_blockwise import blockwise_attention
from tests.unit.test_models_attention import dense_attention, reference_varlen

LENGTHS = [5, 11, 1, 8]


def packed(d: int, dv: int, heads: int = 4, groups: int = 4, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q = torch.randn(t, heads, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(t, groups, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(t, groups, dv, generator=g).to(dtype).requires_grad_()
    return cu, q, k, v


@pytest.mark.parametrize("d,dv", [(24, 16), (16, 24)])
def test_blockwise_and_sdpa_take_another_value_width(d, dv):
    cu, q, k, v = packed(d, dv)
    ref = dense_attention(q, k, v, 0.3, cu)
    assert ref.shape == (cu[-1], 4, dv)
    seq, pos = sequence_coords(cu)
    groups, inverse = kernels.padded_groups(cu)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for out in (blockwise_attention(q, k, v, 0.3, seq, pos, seq, pos, block=4),
                kernels.sdpa_attention(q, k, v, 0.3, groups, inverse)):
        assert out.shape == ref.shape and torch.allclose(out.double(), ref, atol=1e-5)
        for got, want in zip(torch.autograd.grad((out.double() * w).sum(), (q, k, v)), ref_grads):
            assert torch.allclose(got.double(), want.double(), atol=1e-5)


@pytest.mark.parametrize("d,dv", [(24, 16), (16, 24)])
@pytest.mark.parametrize("cp", [1, 2])
def test_varlen_pads_to_one_width_and_cuts_the_output(d, dv, cp):
    """The stand-in asserts the kernel's contract (one head width, a multiple of 8) on what it gets;
    the result is the dense attention's, every CP rank's rows."""
    lengths = [2 * cp * n for n in (3, 1, 2)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(cp)
    q, k = (torch.randn(cu[-1], h, d, generator=g).to(torch.bfloat16) for h in (6, 2))
    v = torch.randn(cu[-1], 2, dv, generator=g).to(torch.bfloat16)
    ref = dense_attention(q, k, v, 0.25, cu)

    def kernel(query, key, value, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), scale=None, enable_gqa=False):
        assert query.shape[-1] == key.shape[-1] == value.shape[-1] == max(d, dv)
        kernels.check_varlen_inputs(query, key, value, kernels.VarlenSegments(
            cu_q.tolist(), cu_k.tolist(), cu_q, cu_k, max_q, max_k))
        return reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, window_size=window_size, scale=scale,
                                enable_gqa=enable_gqa)

    for r in range(cp):
        mine = cp_shard_index(cu, cp, r) if cp > 1 else torch.arange(cu[-1])
        seg = kernels.cp_prefix_segments(cu, cp, r) if cp > 1 else kernels.self_segments(cu)
        out = kernels.varlen_attention(q[mine], k, v, 0.25, seg, fn=kernel)
        assert out.shape == (len(mine), 6, dv) and torch.allclose(out, ref[mine], atol=1e-12)
