"""KL estimators and controllers, whitening, explained variance, DAPO shaping and filters."""

import math

import pytest
import torch

from megarl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    dynamic_sampling_keep,
    dynamic_sampling_sample_mask,
    explained_variance,
    kl_penalty,
    masked_moments,
    masked_whiten,
    masked_whiten_by_role,
    overlong_filter_mask,
    overlong_penalty,
    stats_from_moments,
)


def test_kl_estimators_hand_values():
    logp = torch.tensor([0.5, -1.0, 0.0, 30.0, -30.0])
    ref = torch.zeros(5)
    x = [0.5, -1.0, 0.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), logp)
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), logp.abs())
    torch.testing.assert_close(kl_penalty(logp, ref, "k2")[:3], torch.tensor([0.125, 0.5, 0.0]))
    k3 = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(k3[:3], torch.tensor([math.exp(-xi) + xi - 1 for xi in x]))
    # x = 30 -> clamped to 20: e^-20 + 19 -> result clamped to 10; x = -30 -> e^20 - 21 -> 10
    torch.testing.assert_close(k3[3:], torch.tensor([10.0, 10.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(KeyError, match="low_var_kl"):
        kl_penalty(logp, ref, "k4")


def test_apply_kl_in_reward_and_controllers():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.tensor([[0.2, 0.4], [0.3, 9.0]])
    ref = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, kl = apply_kl_in_reward(scores, logp, ref, mask, beta=0.5, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [-0.15, 0.0]]))
    # per-row token means: 0.3 and 0.3 -> 0.3
    torch.testing.assert_close(kl, torch.tensor(0.3))
    ctl = AdaptiveKLController(value=0.1, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.3, n_steps=10)  # error clipped to 0.2 -> 0.1 * (1 + 0.2*10/100)
    assert math.isclose(ctl.value, 0.102)
    ctl.update(current_kl=0.09, n_steps=10)  # error -0.1 -> * (1 - 0.01)
    assert math.isclose(ctl.value, 0.102 * 0.99)
    fixed = FixedKLController(0.05)
    fixed.update(1.0, 10)
    assert fixed.value == 0.05


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 5.0, -7.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # masked values 1,2,3,5: mean 2.75, unbiased var (3.0625+.5625+.0625+5.0625)/3 = 2.916667
    s = math.sqrt(8.75 / 3 + 1e-8)
    out = masked_whiten(x, m)
    expected = torch.tensor([[(1 - 2.75) / s, (2 - 2.75) / s, 0.0], [(3 - 2.75) / s, (5 - 2.75) / s, 0.0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), (expected + 2.75) * m)
    # global stats via moments of two shards == whole-batch stats
    mom = masked_moments(x[:1], m[:1]) + masked_moments(x[1:], m[1:])
    mean, var = stats_from_moments(mom)
    torch.testing.assert_close(masked_whiten(x[1:], m[1:], stats=(mean, var)).float(), expected[1:])
    with pytest.raises(ValueError, match="no token"):
        masked_whiten(x, torch.zeros(2, 3))
    # single token -> 0, not NaN
    assert masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]])).abs().sum() == 0


def test_masked_whiten_by_role_hand_values():
    x = torch.tensor([[1.0, 3.0, 10.0, 20.0, 7.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    roles = torch.tensor([[0, 0, 1, 1, 1]])
    # role 0: {1, 3}: mean 2, var 2; role 1: {10, 20}: mean 15, var 50
    out = masked_whiten_by_role(x, m, roles)
    s0, s1 = math.sqrt(2 + 1e-8), math.sqrt(50 + 1e-8)
    torch.testing.assert_close(out, torch.tensor([[-1 / s0, 1 / s0, -5 / s1, 5 / s1, 0.0]]))


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # perfect critic -> 1; zero critic -> 0; V = ret + [1,-1,0] -> 1 - 1/1 = 0 (var(ret) = 1, var(diff) = 1)
    torch.testing.assert_close(explained_variance(ret, ret, m), torch.tensor(1.0))
    torch.testing.assert_close(explained_variance(torch.zeros(1, 4), ret, m), torch.tensor(0.0))
    v = ret + torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(explained_variance(v, ret, m), torch.tensor(0.0))
    assert torch.isnan(explained_variance(ret, torch.ones(1, 4), m))


def test_overlong_penalty_dapo_values():
    lengths = torch.tensor([100, 16384, 16385, 18432, 20480, 30000])
    pen = overlong_penalty(lengths, max_len=20480, cache_len=4096)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -1 / 4096, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 20480, 4096, factor=2.0)[3], torch.tensor(-1.0))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(lengths, 100, 0)


def test_overlong_filter_mask():
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = overlong_filter_mask(m, torch.tensor([False, True]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert overlong_filter_mask(m.bool(), torch.tensor([True, False])).tolist() == [[False] * 3, [True] * 3]


def test_dynamic_sampling():
    acc = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    uid = ["q3", "q3", "q1", "q1", "q7", "q7", "q9", "q9"]  # also: q3 all-correct, q1 all-wrong
    keep = dynamic_sampling_keep(acc, uid)
    assert keep.tolist() == [False, False, True, True]  # order: q3, q1, q7, q9
    assert dynamic_sampling_sample_mask(acc, uid).tolist() == [False] * 4 + [True] * 4
    # size-1 group is all-equal -> dropped; tolerance
    assert dynamic_sampling_keep(torch.tensor([1.0, 0.5, 0.5001]), [0, 1, 1], atol=1e-3).tolist() == [False, False]
