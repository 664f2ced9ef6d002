"""Rollout importance sampling (TIS / MIS) against hand-computed values, and its use in the trainer:
weights on the advantages equal weights on the per-token clipped-surrogate loss."""

import math

import pytest
import torch

from megarl import algorithms as A
from megarl.config import load_config
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory

E = math.e
# old (trainer) and rollout (engine) log-probs; mask: 4 tokens count, 2 do not
OLD = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -9.0, 0.0]])
ROLL = torch.tensor([[-1.0, -1.5, -1.0], [-1.0, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
RHO = [1.0, E, 1 / E, math.exp(0.7)]  # the counted tokens' ratios, row-major


def test_ratio_is_exp_of_clamped_log_ratio():
    rho = A.rollout_ratio(OLD, ROLL)
    torch.testing.assert_close(rho[MASK.bool()], torch.tensor(RHO), rtol=1e-6, atol=0)
    assert A.rollout_ratio(torch.tensor([30.0]), torch.tensor([0.0])).item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_tis_caps_the_weight_and_keeps_every_token():
    w, kept, stats = A.rollout_is_weights(OLD, ROLL, MASK, "tis", 2.0)
    expected = torch.tensor([[1.0, 2.0, 1 / E], [2.0, 0.0, 0.0]])  # min(rho, 2); 0 off the mask
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)
    assert torch.equal(kept, MASK)
    m = A.rollout_is_metrics(stats, "tis")
    assert m["rollout_is/ratio_mean"] == pytest.approx(sum(RHO) / 4, rel=1e-6)
    assert m["rollout_is/ratio_max"] == pytest.approx(E, rel=1e-6)
    assert m["rollout_is/capped_frac"] == 0.5  # e and e^0.7 = 2.014 exceed C = 2
    assert m["rollout_is/weight_mean"] == pytest.approx((1 + 2 + 1 / E + 2) / 4, rel=1e-6)


def test_mis_masks_tokens_above_the_threshold_and_weights_the_rest_by_rho():
    w, kept, stats = A.rollout_is_weights(OLD, ROLL, MASK, "mis", 2.0)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1 / E], [0.0, 0.0, 0.0]]), rtol=1e-6, atol=0)
    m = A.rollout_is_metrics(stats, "mis")
    assert m["rollout_is/masked_frac"] == 0.5 and "rollout_is/capped_frac" not in m
    assert m["rollout_is/weight_mean"] == pytest.approx((1 + 1 / E) / 2, rel=1e-6)
    # a threshold above every ratio masks nothing: MIS is then plain per-token IS
    w, kept, _ = A.rollout_is_weights(OLD, ROLL, MASK, "mis", 3.0)
    assert torch.equal(kept, MASK)
    torch.testing.assert_close(w[MASK.bool()], torch.tensor(RHO), rtol=1e-6, atol=0)


def test_bad_mode_or_cap_raise():
    with pytest.raises(ValueError, match="unknown mode"):
        A.rollout_is_weights(OLD, ROLL, MASK, "clip", 2.0)
    with pytest.raises(ValueError, match=">= 1"):
        A.rollout_is_weights(OLD, ROLL, MASK, "tis", 0.5)


def _ppo_token_loss(logp, old, adv, eps_low, eps_high, c):
    """Clipped surrogate with dual clip, one token (docs/algorithms.md §1.1), in Python floats."""
    r = math.exp(logp - old)
    loss = max(-adv * r, -adv * min(max(r, 1 - eps_low), 1 + eps_high))
    return min(loss, -adv * c) if adv < 0 else loss


def test_weighted_advantages_weight_each_token_of_the_clipped_loss():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    old = logp + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)  # ratios well outside the clip
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = 0.2 + 2 * torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[2, 3:] = 0
    loss, _ = A.policy_loss(logp, old, adv * w, mask, 0.2, 0.28, 3.0, agg="token-mean")
    per_token = [w[b, t].item() * _ppo_token_loss(logp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.28, 3.0)
                 for b in range(3) for t in range(5) if mask[b, t]]
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-10)


def _batch():
    trajs = [Trajectory("a", [1, 2], [3, 4, 5], OLD[0].tolist(), "stop", score=1.0, acc=True),
             Trajectory("a", [1, 2], [6], OLD[1, :1].tolist(), "stop", score=-1.0)]
    batch = StepBatch.from_trajectories(trajs)
    batch.rollout_logprobs = ROLL * batch.response_mask
    batch.old_logprobs = OLD * batch.response_mask
    return batch


@pytest.mark.parametrize("mode", [None, "tis", "mis"])
def test_trainer_weights_the_advantages_and_masks_the_loss(mode):
    """GRPO advantages (+1 / -1 for a group of two, on every token) times the IS weights; MIS tokens
    leave the loss mask. Off by default: advantages and mask untouched."""
    overrides = ["rollout.n_samples_per_prompt=2", "algorithm.mini_batch_size=2"]
    cfg = load_config("configs/algorithms/grpo.yaml", overrides + ([f"algorithm.rollout_is={mode}"] if mode else []))
    assert load_config("configs/algorithms/grpo.yaml", overrides).algorithm.rollout_is is None
    batch = _batch()
    rl.set_masks(batch, cfg)
    metrics = rl.rollout_correction(batch, cfg, None)
    rl.compute_advantages(batch, batch, [0, 1], cfg, None, 0.0)
    a = 1 / (math.sqrt(2) + 1e-6)  # (s - mean) / (std + 1e-6) for scores (1, -1): unbiased std sqrt(2)
    base = torch.tensor([[a, a, a], [-a, 0.0, 0.0]])
    if mode is None:
        assert metrics == {} and batch.is_weights is None and torch.equal(batch.loss_mask, MASK)
        torch.testing.assert_close(batch.advantages, base, rtol=1e-5, atol=0)
    elif mode == "tis":
        weights = torch.tensor([[1.0, 2.0, 1 / E], [2.0, 0, 0]])
        torch.testing.assert_close(batch.advantages, base * weights, rtol=1e-5, atol=0)
        assert torch.equal(batch.loss_mask, MASK) and metrics["rollout_is/capped_frac"] == 0.5
    else:
        weights = torch.tensor([[1.0, 0.0, 1 / E], [0.0, 0, 0]])
        torch.testing.assert_close(batch.advantages, base * weights, rtol=1e-5, atol=0)
        assert batch.loss_mask.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
        assert metrics["rollout_is/masked_frac"] == 0.5


def test_config_refuses_losses_without_a_per_token_term():
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.rollout_is"):
        load_config(None, ["algorithm.rollout_is=tis", "algorithm.policy_loss=gspo"])
    with pytest.raises(ConfigError, match="algorithm.rollout_is_cap"):
        load_config(None, ["algorithm.rollout_is=mis", "algorithm.rollout_is_cap=0.9"])
