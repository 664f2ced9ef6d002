"""GAE family: hand-computed values, a naive per-sequence loop reference, edge cases."""

import math

import pytest
import torch

from megarl.algorithms import (
    compute_egae,
    compute_gae,
    decoupled_gae,
    discounted_returns,
    length_adaptive_lambda,
    reverse_linear_scan,
)


def naive_gae_row(r, v, m, gamma, lam, bootstrap=0.0, turn_starts=None):
    """verl's backward loop for ONE sequence, in Python floats (float64)."""
    T = len(r)
    adv = [0.0] * T
    nextvalue, lastgaelam = bootstrap, 0.0
    for t in reversed(range(T)):
        if turn_starts is not None and t + 1 < T and turn_starts[t + 1]:
            nextvalue, lastgaelam = 0.0, 0.0
        if m[t]:
            delta = r[t] + gamma * nextvalue - v[t]
            lastgaelam = delta + gamma * lam * lastgaelam
            nextvalue = v[t]
            adv[t] = lastgaelam
    ret = [(adv[t] + v[t]) if m[t] else 0.0 for t in range(T)]
    return adv, ret


def naive_gae(r, v, m, gamma, lam, bootstrap=None, turn_starts=None):
    B = r.shape[0]
    lams = lam.tolist() if isinstance(lam, torch.Tensor) else [lam] * B
    boots = bootstrap.tolist() if bootstrap is not None else [0.0] * B
    out_a, out_r = [], []
    for b in range(B):
        ts = turn_starts[b].tolist() if turn_starts is not None else None
        a, rt = naive_gae_row(r[b].tolist(), v[b].tolist(), m[b].tolist(), gamma, lams[b], boots[b], ts)
        out_a.append(a)
        out_r.append(rt)
    return torch.tensor(out_a, dtype=torch.float64), torch.tensor(out_r, dtype=torch.float64)


def test_reverse_linear_scan_matches_loop_with_zero_decay_and_padding():
    torch.manual_seed(0)
    for T in (1, 7, 64, 129, 1000):
        x, a = torch.randn(3, T, dtype=torch.float64), torch.rand(3, T, dtype=torch.float64)
        a[0, T // 2] = 0.0
        ref = torch.zeros_like(x)
        c = torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(T)):
            c = x[:, t] + a[:, t] * c
            ref[:, t] = c
        for chunk in (None, 1, 3, 16):
            torch.testing.assert_close(reverse_linear_scan(x, a, chunk=chunk), ref, rtol=1e-12, atol=1e-12)


def test_reverse_linear_scan_leaves_inputs_untouched_and_uses_init():
    for B, T, chunk in ((1, 5, None), (1, 5, 5), (3, 4, 1), (2, 9, 3)):
        x, a = torch.randn(B, T), torch.rand(B, T)
        x0, a0 = x.clone(), a.clone()
        init = torch.full((B,), 2.0)
        y = reverse_linear_scan(x, a, init=init, chunk=chunk)
        assert torch.equal(x, x0) and torch.equal(a, a0)
        # y_{T-1} = x_{T-1} + a_{T-1} * init
        torch.testing.assert_close(y[:, -1], x[:, -1] + 2.0 * a[:, -1])


def test_gae_hand_values_with_masked_hole():
    # m = [1,1,0,1,0]; the reward 5 and value 100 at the masked position must not leak.
    r = torch.tensor([[0.0, 0.0, 5.0, 1.0, 9.0]])
    v = torch.tensor([[1.0, 2.0, 100.0, 3.0, 7.0]])
    m = torch.tensor([[1, 1, 0, 1, 0]])
    adv, ret = compute_gae(r, v, m, gamma=1.0, lam=0.5)
    # t=3: d=1+0-3=-2, A=-2 | t=1: d=0+3-2=1, A=1+0.5*(-2)=0 | t=0: d=0+2-1=1, A=1+0.5*0=1
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, 0.0, -2.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 0.0, 1.0, 0.0]]))


def test_gae_gamma_lambda_hand_values():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.5]])
    adv, ret = compute_gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # d2=1-0.5=0.5; d1=0.9*0.5-0.25=0.2; d0=0.9*0.25-0.5=-0.275
    # A2=0.5; A1=0.2+0.72*0.5=0.56; A0=-0.275+0.72*0.56=0.1282
    torch.testing.assert_close(adv, torch.tensor([[0.1282, 0.56, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.6282, 0.81, 1.0]]))


def test_gae_lambda_one_gamma_one_is_monte_carlo_return():
    r = torch.tensor([[0.1, 0.0, -0.2, 1.0, 0.0]])
    v = torch.tensor([[3.0, -1.0, 2.0, 0.5, 4.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    _, ret = compute_gae(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[0.9, 0.8, 0.8, 1.0, 0.0]]))


def test_gae_matches_naive_loop_random_masks_and_per_row_lambda():
    torch.manual_seed(1)
    B, T = 6, 53
    r = torch.randn(B, T, dtype=torch.float64)
    v = torch.randn(B, T, dtype=torch.float64)
    m = (torch.rand(B, T) > 0.3).to(torch.int64)
    m[0] = 0  # empty row
    m[1] = 0
    m[1, 5] = 1  # length-1 response
    lam = torch.tensor([1.0, 0.95, 0.0, 0.5, 0.99, 0.7], dtype=torch.float64)
    for gamma, lam_arg in ((1.0, 1.0), (0.99, 0.95), (0.9, lam)):
        adv, ret = compute_gae(r, v, m, gamma, lam_arg)
        ref_a, ref_r = naive_gae(r, v, m, gamma, lam_arg)
        torch.testing.assert_close(adv, ref_a, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ret, ref_r, rtol=1e-10, atol=1e-10)
    assert adv[0].abs().sum() == 0
    # length-1: A = r - V
    torch.testing.assert_close(adv[1, 5], r[1, 5] - v[1, 5])


def test_gae_long_sequence_float32_no_underflow_problems():
    torch.manual_seed(2)
    B, T = 2, 6000  # 0.95**6000 underflows float32; a cumprod/divide closed form would break
    r = torch.zeros(B, T)
    r[:, -1] = 1.0
    v = torch.rand(B, T)
    m = torch.ones(B, T)
    adv, _ = compute_gae(r, v, m, 1.0, 0.95)
    ref_a, _ = naive_gae(r.double(), v.double(), m, 1.0, 0.95)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.double(), ref_a, rtol=1e-4, atol=1e-4)


def test_gae_turn_starts_reset_hand_values():
    # turn 1 = positions 0,1 ; template at 2 (m=0, flagged as turn start) ; turn 2 = 3,4
    r = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 0.25, 9.0, 1.0, 1.5]])
    m = torch.tensor([[1, 1, 0, 1, 1]])
    ts = torch.tensor([[False, False, True, False, False]])
    adv, ret = compute_gae(r, v, m, 1.0, 1.0, turn_starts=ts)
    # turn 2: A4 = 2-1.5 = 0.5; A3 = (0+1.5-1) + 0.5 = 1.0
    # turn 1 (reset): A1 = 1+0-0.25 = 0.75; A0 = (0+0.25-0.5) + 0.75 = 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75, 0.0, 1.0, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 2.0, 2.0]]))
    # flag on the first response token of turn 2 instead: same result
    ts2 = torch.tensor([[False, False, False, True, False]])
    adv2, _ = compute_gae(r, v, m, 1.0, 1.0, turn_starts=ts2)
    torch.testing.assert_close(adv2, adv)
    # without the reset the carry crosses turns: A1 = 1 + 1.0(V3) - 0.25 + A3
    adv3, _ = compute_gae(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(adv3[0, 1], torch.tensor(1.75 + 1.0))


def test_gae_turn_starts_matches_naive_random():
    torch.manual_seed(3)
    B, T = 5, 40
    r, v = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    m = (torch.rand(B, T) > 0.25).long()
    ts = torch.rand(B, T) > 0.85
    adv, ret = compute_gae(r, v, m, 0.97, 0.9, turn_starts=ts)
    ref_a, ref_r = naive_gae(r, v, m, 0.97, 0.9, turn_starts=ts)
    torch.testing.assert_close(adv, ref_a, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_r, rtol=1e-10, atol=1e-10)


def test_length_adaptive_lambda_values_and_clamp():
    lam = length_adaptive_lambda(torch.tensor([100, 1000, 10000, 20, 5, 0, 10**9]), alpha=0.05)
    torch.testing.assert_close(lam[:4], torch.tensor([0.8, 0.98, 0.998, 0.0]))
    assert lam[4] == 0.0 and lam[5] == 0.0
    assert lam[6] < 1.0
    with pytest.raises(ValueError):
        length_adaptive_lambda(torch.tensor([10]), alpha=0.0)


def test_decoupled_gae_hand_values():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.5]])
    adv, ret = decoupled_gae(r, v, torch.ones(1, 3), gamma=1.0, lam_actor=0.5, lam_critic=1.0)
    # deltas: d0 = 0.25-0.5 = -0.25, d1 = 0.5-0.25 = 0.25, d2 = 1-0.5 = 0.5
    # actor lam .5: A2 = .5, A1 = .25+.25 = .5, A0 = -.25+.25 = 0
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.5]]))
    # critic lam 1: returns = Monte-Carlo return = 1 everywhere (not adv + V)
    torch.testing.assert_close(ret, torch.ones(1, 3))


def test_egae_truncated_and_finished_rows():
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 0.75, 0.0], [0.5, 0.25, 0.5, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    truncated = torch.tensor([True, False])
    adv, ret = compute_egae(r, v, m, truncated, gamma=1.0, lam=1.0)
    # truncated row: V(s_3) ~ V(s_2) = .75 -> d2 = 0; d1 = .75-.25 = .5; d0 = .25-.5 = -.25
    # A = [.25, .5, 0]; returns = .75 everywhere
    torch.testing.assert_close(adv[0], torch.tensor([0.25, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([0.75, 0.75, 0.75, 0.0]))
    # finished row: plain GAE, MC return 1
    torch.testing.assert_close(ret[1], torch.tensor([1.0, 1.0, 1.0, 0.0]))
    plain_a, _ = compute_gae(r[1:], v[1:], m[1:], 1.0, 1.0)
    torch.testing.assert_close(adv[1:], plain_a)
    # decoupled variant: returns from lam_critic
    adv_d, ret_d = compute_egae(r, v, m, truncated, 1.0, 0.5, lam_critic=1.0)
    torch.testing.assert_close(ret_d, ret)
    # truncated, actor lam .5: A2 = 0, A1 = .5, A0 = -.25 + .25 = 0
    torch.testing.assert_close(adv_d[0], torch.tensor([0.0, 0.5, 0.0, 0.0]))


def test_egae_empty_truncated_row_is_zero():
    adv, ret = compute_egae(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3), torch.tensor([True]), 1.0, 1.0)
    assert adv.abs().sum() == 0 and ret.abs().sum() == 0


def test_discounted_returns_hand_values():
    r = torch.tensor([[1.0, 0.0, 7.0, 2.0, 3.0]])
    m = torch.tensor([[1, 1, 0, 1, 0]])
    g = discounted_returns(r, m, gamma=0.5)
    # masked reward 7 and 3 ignored: G3 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5
    torch.testing.assert_close(g, torch.tensor([[1.5, 1.0, 0.0, 2.0, 0.0]]))


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="values"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="lam"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.5)
    with pytest.raises(ValueError, match="truncated"):
        compute_egae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(3, dtype=torch.bool))


def test_gae_bfloat16_inputs_are_upcast():
    r = torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)
    v = torch.tensor([[0.5, 0.5]], dtype=torch.bfloat16)
    adv, _ = compute_gae(r, v, torch.ones(1, 2), 1.0, 1.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    assert math.isclose(adv.sum().item(), 1.0)
