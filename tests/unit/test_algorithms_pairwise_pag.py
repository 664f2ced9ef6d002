"""Pairwise-RL reward/advantage and PAG per-turn rewards, turn layout, turn-independent GAE."""

import pytest
import torch

from megarl.algorithms import (
    AdvantageInputs,
    AdvantageParams,
    compute_advantages,
    compute_gae,
    pag_turn_layout,
    pag_turn_rewards,
    pairwise_advantages,
    pairwise_reward,
)


def test_pairwise_reward_hand_values():
    r = pairwise_reward(torch.tensor([0.8, 0.5, 1.0]), torch.tensor([0.4, 0.5, 0.0]))
    torch.testing.assert_close(r, torch.tensor([0.7, 0.5, 1.0]))
    with pytest.raises(ValueError, match="p_second"):
        pairwise_reward(torch.tensor([0.5]), torch.tensor([1.5]))


def test_pairwise_advantages_places_centred_reward_then_gae():
    values = torch.tensor([[0.1, 0.3, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = pairwise_advantages(torch.tensor([0.8]), torch.tensor([0.4]), values, mask)
    # r - 0.5 = 0.2 on token 1; d1 = 0.2 - 0.3 = -0.1, d0 = 0.3 - 0.1 = 0.2; lam 1: A0 = 0.1
    torch.testing.assert_close(adv, torch.tensor([[0.1, -0.1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.2, 0.2, 0.0]]))
    _, ret_raw = pairwise_advantages(torch.tensor([0.8]), torch.tensor([0.4]), values, mask, centre=0.0)
    torch.testing.assert_close(ret_raw, torch.tensor([[0.7, 0.7, 0.0]]))


def _pag_batch():
    # row 0: attempt (wrong, ends 2), verify (says wrong, ends 5), revision (correct, ends 8)
    # row 1: attempt (correct, ends 1), verify (no verdict, ends 3)
    # row 2: attempt (wrong, ends 1), verify (says correct -> wrong verdict, ends 4)
    ends = torch.tensor([[2, 5, 8], [1, 3, -1], [1, 4, -1]])
    is_pol = torch.tensor([[True, False, True], [True, False, False], [True, False, False]])
    correct = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 0, 0]])
    verdict = torch.tensor([[-1, 0, -1], [-1, -1, -1], [-1, 1, -1]])
    return ends, is_pol, correct, verdict


def test_pag_turn_rewards_hand_values():
    ends, is_pol, correct, verdict = _pag_batch()
    r = pag_turn_rewards(ends, is_pol, correct, verdict, T=10, alpha=1.0)
    expected = torch.zeros(3, 10)
    expected[0, 5] = 1.0  # verdict "wrong" matches a wrong answer
    expected[0, 8] = 1.0 + 1.0 * (1 - 0)  # correct revision + bonus alpha*(1 - 0)
    expected[1, 1] = 1.0  # correct attempt; missing verdict -> 0
    expected[2, 4] = 0.0  # "correct" on a wrong answer
    torch.testing.assert_close(r, expected)
    r5 = pag_turn_rewards(ends, is_pol, correct, verdict, T=10, alpha=5.0)
    assert r5[0, 8] == 6.0
    # a revision that breaks a correct answer: 0 + alpha*(0 - 1)
    r_bad = pag_turn_rewards(
        torch.tensor([[0, 1, 2]]), torch.tensor([[True, False, True]]), torch.tensor([[1, 0, 0]]),
        torch.tensor([[-1, 0, -1]]), T=3,
    )
    torch.testing.assert_close(r_bad, torch.tensor([[1.0, 0.0, -1.0]]))


def test_pag_bad_turns_raise():
    with pytest.raises(ValueError, match="no earlier policy turn"):
        pag_turn_rewards(torch.tensor([[1, 3]]), torch.tensor([[False, True]]), torch.zeros(1, 2), torch.zeros(1, 2), 5)
    with pytest.raises(ValueError, match="increase"):
        pag_turn_layout(torch.tensor([[3, 2]]), torch.tensor([[True, False]]), 5)
    with pytest.raises(ValueError, match="prefix"):
        pag_turn_layout(torch.tensor([[-1, 2]]), torch.tensor([[True, False]]), 5)
    with pytest.raises(ValueError, match=">= T"):
        pag_turn_layout(torch.tensor([[1, 5]]), torch.tensor([[True, False]]), 5)


def test_pag_turn_layout_hand_values():
    ends, is_pol, _, _ = _pag_batch()
    starts, roles = pag_turn_layout(ends, is_pol, T=10)
    assert starts[0].nonzero().flatten().tolist() == [3, 6]
    assert starts[1].nonzero().flatten().tolist() == [2]
    assert roles[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, -1]
    assert roles[1].tolist() == [0, 0, 1, 1, -1, -1, -1, -1, -1, -1]


def test_pag_turn_independent_gae_equals_per_turn_gae():
    ends, is_pol, correct, verdict = _pag_batch()
    T = 10
    rewards = pag_turn_rewards(ends, is_pol, correct, verdict, T)
    starts, roles = pag_turn_layout(ends, is_pol, T)
    torch.manual_seed(0)
    values = torch.randn(3, T)
    mask = (roles >= 0).long()
    mask[0, 3] = 0  # template tokens at the start of the verifier and revision turns
    mask[0, 6] = 0
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.9, turn_starts=starts)
    # each turn on its own (a separate sequence) must give the same numbers
    for b in range(3):
        lo = 0
        for k in range(3):
            e = int(ends[b, k])
            if e < 0:
                break
            a_k, r_k = compute_gae(rewards[b:b + 1, lo:e + 1], values[b:b + 1, lo:e + 1], mask[b:b + 1, lo:e + 1], 1.0, 0.9)
            torch.testing.assert_close(adv[b:b + 1, lo:e + 1], a_k)
            torch.testing.assert_close(ret[b:b + 1, lo:e + 1], r_k)
            lo = e + 1
    # full estimator with RoleAdvNorm: each role's masked tokens have mean 0, unbiased std ~1
    out, _ = compute_advantages(
        "gae",
        AdvantageInputs(rewards, mask, values=values, turn_starts=starts, role_ids=roles),
        AdvantageParams(gamma=1.0, lam=0.9),
    )
    for role in (0, 1):
        sel = (roles == role) & (mask > 0)
        torch.testing.assert_close(out[sel].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
        torch.testing.assert_close(out[sel].std(), torch.tensor(1.0), atol=1e-4, rtol=0)
