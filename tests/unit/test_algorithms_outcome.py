"""GRPO / Dr. GRPO / RLOO / REINFORCE++ / outcome placement against hand-computed values."""

import math

import pytest
import torch

from megarl.algorithms import (broadcast_to_tokens, group_ids, grpo_advantages, place_outcome_reward,
                               reinforce_pp_advantages, rloo_advantages)


def test_group_ids_first_appearance_order():
    ids, G = group_ids(torch.tensor([7, 3, 7, 1, 3]))
    assert G == 3 and ids.tolist() == [0, 1, 0, 2, 1]
    ids, G = group_ids(["b", "a", "b", "c"])
    assert G == 3 and ids.tolist() == [0, 1, 0, 2]


def test_grpo_hand_values():
    # group "a" = [1, 0, 1]: mean 2/3, unbiased var ((1/3)^2*2 + (2/3)^2)/2 = 1/3, std 0.577350
    # group "b" = [5] (size 1): mean 0, std 1 -> 5/(1+1e-6)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 5.0]), ["a", "a", "a", "b"])
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([(1 / 3) / s, -(2 / 3) / s, (1 / 3) / s, 5 / (1 + 1e-6)]))


def test_grpo_interleaved_integer_groups_and_dr_grpo():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0])
    index = torch.tensor([10, 20, 10, 20])
    # group 10 = [1, 3]: mean 2, std sqrt(2); group 20 = [2, 6]: mean 4, std sqrt(8)
    adv = grpo_advantages(scores, index)
    r2, r8 = math.sqrt(2) + 1e-6, math.sqrt(8) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([-1 / r2, -2 / r8, 1 / r2, 2 / r8]))
    torch.testing.assert_close(grpo_advantages(scores, index, norm_by_std=False), torch.tensor([-1.0, -2.0, 1.0, 2.0]))


def test_grpo_all_equal_group_gives_zero():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]), [0, 0, 0, 1, 1])
    assert torch.equal(adv, torch.zeros(5))


def test_rloo_hand_values():
    # group 0 = [1, 0, 2]: A_i = s_i - mean(others): 1-1 = 0, 0-1.5 = -1.5, 2-0.5 = 1.5; group 1 = [4]: A = 4
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 2.0, 4.0]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 4.0]))


def test_place_outcome_reward_last_valid_token_and_empty_row():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]])
    r = place_outcome_reward(torch.tensor([2.0, -1.0, 5.0, 3.0, 4.0]), mask)
    expected = torch.tensor(
        [[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 3.0], [0, 0, 0, 4.0]]
    )
    torch.testing.assert_close(r, expected)


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([1.0]), torch.ones(2, 3))


def test_reinforce_pp_hand_values():
    # gamma 0.5; row 0 rewards [0, 0, 4] -> G = [1, 2, 4]; row 1 rewards [0, 2, pad] -> G = [1, 2]
    r = torch.tensor([[0.0, 0.0, 4.0], [0.0, 2.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(r, m, gamma=0.5)
    # G over masked tokens = [1, 2, 4, 1, 2]: mean 2, unbiased var (1+0+4+1+0)/4 = 1.5
    s = math.sqrt(1.5 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[-1 / s, 0.0, 2 / s], [-1 / s, 0.0, 0.0]]))


def test_reinforce_pp_baseline_hand_values():
    r = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0]])
    m = torch.tensor([[1, 1], [1, 1], [1, 0]])
    # scores: 1, 3, 0 (the 2 is masked); groups [0,0,1]: centred 1-2=-1, 3-2=1, group size 1 -> 0
    # token values [-1,-1, 1,1, 0]: mean 0, unbiased var 4/4 = 1
    adv = reinforce_pp_advantages(r, m, group_index=[0, 0, 1])
    s = math.sqrt(1.0 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[-1 / s, -1 / s], [1 / s, 1 / s], [0.0, 0.0]]))


def test_length_mismatch_errors():
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(torch.zeros(3), [0, 1])
    with pytest.raises(ValueError, match="1-D"):
        rloo_advantages(torch.zeros(2, 2), [0, 1])
