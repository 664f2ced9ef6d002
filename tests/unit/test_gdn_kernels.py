"""The gated delta-net math of megarl.models.gdn_kernels against transformers 5.19's torch reference
kernels (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`,
each run on one sequence at a time), the recurrence written out token by token, and the packed-row
contract: a sequence's outputs do not depend on the sequences packed before it."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from megarl.models import gdn_kernels as K

LENGTHS = [5, 70, 1, 33, 130]  # shorter and longer than a chunk (64), a single token, two chunks+
H, DK, DV, C, W = 3, 8, 12, 10, 4


def packed(lengths=LENGTHS, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q, k = torch.randn(t, H, DK, generator=gen), torch.randn(t, H, DK, generator=gen)
    v = torch.randn(t, H, DV, generator=gen)
    g = -2 * torch.rand(t, H, generator=gen)  # log decays in (-2, 0]
    beta = torch.rand(t, H, generator=gen)
    return cu, [x.to(dtype) for x in (q, k, v, g, beta)]


def recurrence(q, k, v, g, beta):
    """The rule of the module doc, one token at a time in float64, straight from the formula:
    S_t = exp(g_t) S + beta_t k_t (v_t - exp(g_t) S^T k_t)^T,  o_t = S_t^T q_t / sqrt(d_k)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        decayed = torch.exp(g[t])[:, None, None] * state
        err = v[t] - torch.einsum("hkv,hk->hv", decayed, k[t])
        state = decayed + beta[t][:, None, None] * k[t][:, :, None] * err[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]) / q.shape[-1] ** 0.5)
    return torch.stack(out), state


def test_chunked_rule_equals_transformers_and_the_recurrence_per_sequence():
    cu, (q, k, v, g, beta) = packed()
    out, finals = K.chunk_gated_delta_rule(q, k, v, g, beta, cu, output_final_state=True)
    assert out.shape == v.shape and finals.shape == (len(LENGTHS), H, DK, DV)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        args = [x[None, s:e] for x in (q, k, v, g, beta)]
        ref, ref_state = hf.torch_chunk_gated_delta_rule(*args, output_final_state=True, use_qk_l2norm_in_kernel=True)
        rec, _ = hf.torch_recurrent_gated_delta_rule(*args, output_final_state=True, use_qk_l2norm_in_kernel=True)
        exact, exact_state = recurrence(*(x[s:e] for x in (q, k, v, g, beta)))
        assert (out[s:e] - ref[0]).abs().max() <= 1e-5 and (finals[i] - ref_state[0]).abs().max() <= 1e-5
        assert (out[s:e] - rec[0]).abs().max() <= 1e-5
        assert (out[s:e].double() - exact).abs().max() <= 1e-5 and (finals[i].double() - exact_state).abs().max() <= 1e-5


def test_a_sequence_does_not_see_the_sequences_packed_before_it():
    cu, (q, k, v, g, beta) = packed()
    out, _ = K.chunk_gated_delta_rule(q, k, v, g, beta, cu)
    first = slice(cu[0], cu[2])  # change everything of the first two sequences
    changed = [x.clone() for x in (q, k, v, g, beta)]
    gen = torch.Generator().manual_seed(7)
    for x in changed:
        x[first] = torch.randn(x[first].shape, generator=gen) - (1.0 if x is changed[3] else 0.0)
    out2, _ = K.chunk_gated_delta_rule(*changed, cu)
    assert not torch.allclose(out2[first], out[first])
    assert torch.equal(out2[cu[2]:], out[cu[2]:])  # bit-identical: the state starts at zero at the boundary


def test_the_convolution_restarts_at_every_sequence_and_equals_transformers():
    cu, _ = packed()
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(cu[-1], C, generator=gen), torch.randn(C, W, generator=gen)
    y = K.causal_conv1d_packed(x, w, cu)
    for s, e in zip(cu[:-1], cu[1:]):
        ref = hf.causal_conv1d_fn(x[s:e].T[None], w, None, activation="silu")[0].T
        assert (y[s:e] - ref).abs().max() <= 1e-5
    x2 = x.clone()
    x2[: cu[1]] += 5.0
    assert torch.equal(K.causal_conv1d_packed(x2, w, cu)[cu[1]:], y[cu[1]:])


def test_decode_steps_continue_a_prefill():
    """Prefill the first n tokens (chunked, final conv / recurrent states kept), then one step per
    token: the same outputs as the chunked rule over the whole sequence."""
    cu, (q, k, v, g, beta) = packed([50])
    full, _ = K.chunk_gated_delta_rule(q, k, v, g, beta, cu)
    n = 37
    _, state = K.chunk_gated_delta_rule(*(x[:n] for x in (q, k, v, g, beta)), [0, n], output_final_state=True)
    for t in range(n, 50):
        o, state = K.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        assert (o[0] - full[t]).abs().max() <= 1e-5
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 20, C, generator=gen), torch.randn(C, W, generator=gen)
    conv = K.causal_conv1d_packed(x[0], w, [0, 20])
    conv_state = K.last_inputs(x[:, :12], W)
    for t in range(12, 20):
        y, conv_state = K.conv_step(x[:, t], conv_state, w)
        assert (y[0] - conv[t]).abs().max() <= 1e-6
    assert K.last_inputs(x[:, :2], W).shape == (1, C, W - 1)  # a short row: zeros in front
    assert torch.equal(K.last_inputs(x[:, :2], W)[..., 0], torch.zeros(1, C))


def test_gradients_of_the_chunked_rule_equal_the_recurrence():
    cu, args = packed([9, 70])
    leaves = [x.double().requires_grad_() for x in args]
    out, _ = K.chunk_gated_delta_rule(*leaves, cu)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), leaves)
    leaves2 = [x.double().requires_grad_() for x in args]
    ref = torch.cat([recurrence(*(x[s:e] for x in leaves2))[0] for s, e in zip(cu[:-1], cu[1:])])
    ref_grads = torch.autograd.grad((ref * weights).sum(), leaves2)
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))


def test_gates():
    a, b = torch.tensor([[0.3, -1.0]]), torch.tensor([[2.0, -0.5]])
    A_log, dt_bias = torch.tensor([0.1, 1.2]), torch.tensor([0.5, -0.2])
    g, beta = K.gdn_gates(a, b, A_log, dt_bias)
    sp = torch.log1p(torch.exp(a + dt_bias))
    assert torch.allclose(g, -torch.exp(A_log) * sp) and torch.allclose(beta, 1 / (1 + torch.exp(-b)))


def test_kernel_selection():
    sel = K.select_gdn_kernel
    assert sel("cpu", torch.bfloat16, forced="auto", has_fla=True, cuda_runtime=False) == "torch"
    assert sel("cuda", torch.bfloat16, forced="auto", has_fla=True, cuda_runtime=True) == "fla"
    assert sel("cuda", torch.float32, forced="auto", has_fla=True, cuda_runtime=True) == "torch"  # fla refuses fp32
    assert sel("cuda", torch.bfloat16, forced="auto", has_fla=False, cuda_runtime=True) == "torch"
    assert sel("cuda", torch.bfloat16, forced="auto", has_fla=True, cuda_runtime=False) == "torch"  # strict device mode
    with pytest.raises(ValueError, match="'fla' needs CUDA"):
        sel("cpu", torch.bfloat16, forced="fla", has_fla=True, cuda_runtime=False)
    with pytest.raises(ValueError, match="unknown gated delta-net kernel"):
        K.use_gdn_kernel("triton")
    with K.forced_gdn_kernel("torch"):
        assert sel("cuda", torch.bfloat16, has_fla=True, cuda_runtime=True) == "torch"


def _fla_semantics_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel):
    """flash-linear-attention's documented `chunk_gated_delta_rule` semantics ([1, T, H, d] inputs,
    int64 cu_seqlens, L2 norm in the kernel, scale = d_k^-1/2), computed by the torch kernel."""
    assert use_qk_l2norm_in_kernel and abs(scale - q.shape[-1] ** -0.5) < 1e-12 and initial_state is None
    o, _ = K.chunk_gated_delta_rule(q[0].float(), k[0].float(), v[0].float(), g[0], beta[0].float(),
                                    cu_seqlens.tolist())
    return o[None].to(q.dtype), None


def _fla_semantics_conv(x, weight, bias, activation, cu_seqlens):
    assert bias is None and activation == "silu" and x.shape[0] == 1
    return K.causal_conv1d_packed(x[0], weight, cu_seqlens.tolist())[None], None


def test_fla_adapters_keep_the_varlen_contract():
    """The arguments megarl hands flash-linear-attention (checked by `check_fla_inputs`), through
    stand-ins with its documented semantics: the same outputs as the torch path."""
    cu, (q, k, v, g, beta) = packed(dtype=torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.long)
    out = K.fla_gated_delta_rule(q, k, v, g.float(), beta, cu_t, fn=_fla_semantics_rule)
    ref, _ = K.chunk_gated_delta_rule(q, k, v, g.float(), beta, cu)
    assert out.shape == v.shape and torch.equal(out, ref)
    with pytest.raises(TypeError, match="bf16/fp16"):
        K.fla_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta, cu_t, fn=_fla_semantics_rule)
    with pytest.raises(ValueError, match="cu_seqlens must be int64"):
        K.fla_gated_delta_rule(q, k, v, g.float(), beta, cu_t.int(), fn=_fla_semantics_rule)
    x, w = torch.randn(cu[-1], C), torch.randn(C, W)
    assert torch.equal(K.fla_causal_conv1d(x, w, cu_t, fn=_fla_semantics_conv), K.causal_conv1d_packed(x, w, cu))
    with pytest.raises(ValueError, match="int64 cu_seqlens"):
        K.fla_causal_conv1d(x, w, cu_t[:-1], fn=_fla_semantics_conv)
