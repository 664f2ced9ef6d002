"""T-PPO advantages on carried samples (EGAE with windows), token filtering, through the trainer's
own mask and advantage code, against values computed by hand (gamma 1, lambda_actor 0.5,
lambda_critic 1).

Sample A: carried, still unfinished; response of 6 tokens, the current window is tokens 3..5.
  V = .1 .2 .3 .4 .5 .6, no reward. EGAE bootstraps V(s_6) ~ V(s_5) = .6, so
  delta_0..4 = .1, delta_5 = .6 - .6 = 0; A_5 = 0, A_4 = .1, A_3 = .1 + .5 * .1 = .15.
Sample B: carried, finished now (EOS) at 5 tokens, the current window is token 4 only.
  V = .5 .5 .5 .5 .8, reward 1 on token 4: delta_4 = 1 - .8 = .2, so A_4 = .2;
  Monte-Carlo critic targets: 1 on every token.
Sample C: new this step, finished at 3 tokens, reward -1, V = 0 -.5 -.5:
  delta = -.5, 0, -.5; A_2 = -.5, A_1 = -.25, A_0 = -.5 + .5 * -.25 = -.625; targets -1.
"""

import statistics

import pytest
import torch

from megarl import algorithms as A
from megarl.config import load_config
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory

VALUES = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.5, 0.5, 0.5, 0.5, 0.8], [0.0, -0.5, -0.5]]
POLICY_ADV = {0: {3: 0.15, 4: 0.1, 5: 0.0}, 1: {4: 0.2}, 2: {0: -0.625, 1: -0.25, 2: -0.5}}


def config(*extra):
    return load_config("configs/algorithms/tppo.yaml", ["algorithm.lam_actor=0.5", "algorithm.whiten_advantages=false",
                                                        "rollout.max_new_tokens=16", "rollout.window_tokens=3", *extra])


def carried_batch(values=VALUES) -> StepBatch:
    trajs = [
        Trajectory("a", [7, 8], [1, 2, 3, 4, 5, 6], [-1.0] * 6, "truncated", policy_version=4, window_start=3,
                   start_version=3),
        Trajectory("b", [7, 9], [1, 2, 3, 4, 5], [-1.0] * 5, "stop", score=1.0, acc=True, policy_version=4,
                   window_start=4, start_version=2),
        Trajectory("c", [7], [1, 2, 3], [-1.0] * 3, "stop", score=-1.0, policy_version=4),
    ]
    batch = StepBatch.from_trajectories(trajs)
    batch.values = torch.zeros_like(batch.response_mask)
    for i, v in enumerate(values):
        batch.values[i, : len(v)] = torch.tensor(v)
    return batch


def advantages(batch, cfg):
    rl.set_masks(batch, cfg)
    rl.compute_advantages(batch, batch, list(range(len(batch))), cfg, None, 0.0)
    return batch


def test_policy_tokens_are_the_current_windows_and_value_tokens_the_finished_samples():
    batch = advantages(carried_batch(), config())
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert batch.value_mask.tolist() == [[0] * 6, [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    # the other reading of the paper: every response token trains the policy
    again = advantages(carried_batch(), config("algorithm.retrain_earlier_windows=true"))
    assert torch.equal(again.loss_mask, again.response_mask)


def test_egae_with_carry_matches_hand_computed_values():
    batch = advantages(carried_batch(), config())
    for row, expected in POLICY_ADV.items():
        for col, a in expected.items():
            assert batch.advantages[row, col].item() == pytest.approx(a, abs=1e-6), (row, col)
    critic = batch.returns * batch.value_mask
    torch.testing.assert_close(critic[1, :5], torch.ones(5))
    torch.testing.assert_close(critic[2, :3], -torch.ones(3))


def test_earlier_windows_do_not_change_the_current_windows_advantages():
    """The carried tokens' values (under the new critic) enter no advantage of a later token."""
    other = [[9.0, -3.0, 7.0, 0.4, 0.5, 0.6], [2.0, 2.0, -2.0, 0.5, 0.8], VALUES[2]]
    a, b = advantages(carried_batch(), config()), advantages(carried_batch(other), config())
    torch.testing.assert_close(a.advantages * a.loss_mask, b.advantages * b.loss_mask)


def test_whitening_uses_the_policy_tokens_only():
    batch = advantages(carried_batch(), config("algorithm.whiten_advantages=true"))
    raw = [a for row in POLICY_ADV.values() for a in row.values()]
    mean, std = statistics.mean(raw), statistics.stdev(raw)  # unbiased, as verl
    for row, expected in POLICY_ADV.items():
        for col, a in expected.items():
            assert batch.advantages[row, col].item() == pytest.approx((a - mean) / std, rel=1e-5), (row, col)


def test_staleness_counts_policy_updates_spanned():
    batch = carried_batch()
    assert A.staleness(torch.tensor([4, 4, 4]), batch.start_version).tolist() == [1, 2, 0]
    assert A.staleness_histogram([1, 2, 0, 2]) == {0: 1, 1: 1, 2: 2} and A.staleness_histogram([]) == {}
