"""Values and returns line up with the tokens they score: the value of response token j is read
from the model output at the last position before token j (the state that chooses it), and the
critic's Monte-Carlo target at every token is the sample's outcome."""

from __future__ import annotations

import torch

from megarl.config import load_config
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory, build_microbatch


def two_samples() -> StepBatch:
    trajs = [Trajectory(uid="a", prompt_ids=[5, 6, 7], response_ids=[8, 9], rollout_logprobs=[0.0, 0.0],
                        finish_reason="stop", score=1.0, acc=True),
             Trajectory(uid="b", prompt_ids=[5, 6], response_ids=[10, 11, 12], rollout_logprobs=[0.0] * 3,
                        finish_reason="stop", score=-1.0)]
    return StepBatch.from_trajectories(trajs)


def test_value_of_token_j_is_read_before_token_j():
    batch = two_samples()
    mb = build_microbatch(batch, [0, 1])
    # packed row: [5 6 7 8 9 | 5 6 10 11 12]; an output equal to the position index shows where each value is read
    out = torch.arange(mb.input_ids.shape[1], dtype=torch.float32).reshape(1, -1, 1)
    values = mb.values(out)
    # sample a: token 8 (position 3) is chosen at position 2 (token 7), token 9 at position 3
    # sample b (offset 5): token 10 (position 7) at position 6, 11 at 7, 12 at 8; padding stays 0
    assert values.tolist() == [[2.0, 3.0, 0.0], [6.0, 7.0, 8.0]]
    assert mb.input_ids[0, 2].item() == 7 and mb.input_ids[0, 6].item() == 6  # the last token before each response


def test_monte_carlo_targets_are_the_outcome_at_every_token():
    cfg = load_config("configs/algorithms/vapo.yaml", [])
    batch = two_samples()
    rl.set_masks(batch, cfg)
    batch.old_logprobs = torch.zeros_like(batch.response_mask)
    batch.values = torch.tensor([[0.3, -0.2, 0.0], [0.5, 0.1, -0.4]])
    for pretraining in (True, False):  # lam_critic 1.0 in both phases: the return does not depend on V
        rl.compute_advantages(batch, batch, [0, 1], cfg, None, 0.0, value_pretraining=pretraining)
        assert batch.returns.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
    # explained variance of these values, by hand over the 5 value tokens:
    # returns r = [1, 1, -1, -1, -1], r - V = [0.7, 1.2, -1.5, -1.1, -0.6]
    r = torch.tensor([1.0, 1, -1, -1, -1])
    d = torch.tensor([0.7, 1.2, -1.5, -1.1, -0.6])
    expected = 1 - d.var(unbiased=False) / r.var(unbiased=False)
    assert abs(rl.explained_variance(batch, None)["critic/explained_variance"] - expected.item()) < 1e-5



def test_explained_variance_is_zero_when_every_sample_scored_the_same():
    cfg = load_config("configs/algorithms/vapo.yaml", [])
    batch = two_samples()
    batch.score = torch.tensor([-1.0, -1.0])  # all failed: nothing to explain
    rl.set_masks(batch, cfg)
    batch.old_logprobs = torch.zeros_like(batch.response_mask)
    batch.values = torch.tensor([[0.3, -0.2, 0.0], [0.5, 0.1, -0.4]]) * batch.response_mask
    rl.compute_advantages(batch, batch, [0, 1], cfg, None, 0.0, value_pretraining=True)
    # returns = (sum of TD errors) + V in float32: -1 up to rounding, so Var(ret) is ~1e-15, not 0
    assert torch.allclose(batch.returns, -batch.response_mask, atol=1e-6)
    assert rl.explained_variance(batch, None)["critic/explained_variance"] == 0.0
