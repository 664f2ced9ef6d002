"""Registries: config names resolve, unknown names list the valid ones, estimators match the
underlying functions."""

import pytest
import torch

import megarl.algorithms as A
from megarl.algorithms import ADVANTAGES, KL_PENALTIES, LOSS_AGGS, POLICY_LOSSES, AdvantageInputs, AdvantageParams


def test_config_names_registered():
    assert {"gae", "egae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(ADVANTAGES)
    assert {"ppo", "vanilla_pg"} <= set(POLICY_LOSSES)
    assert POLICY_LOSSES["ppo"] is A.policy_loss
    assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"} <= set(LOSS_AGGS)
    assert {"k1", "k2", "k3", "low_var_kl", "abs"} <= set(KL_PENALTIES)


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError) as e:
        ADVANTAGES["ppo_gae"]
    msg = str(e.value)
    assert "advantage estimator" in msg and "'ppo_gae'" in msg and "grpo" in msg and "rloo" in msg
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("ppo")(lambda: None)


def _batch():
    torch.manual_seed(0)
    B, T = 6, 30
    lengths = torch.tensor([30, 25, 3, 12, 30, 18])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    rewards = A.place_outcome_reward(scores, mask)
    values = torch.randn(B, T) * 0.1
    return rewards, mask, values, scores, lengths


def test_gae_estimator_vapo_settings_match_direct_calls():
    rewards, mask, values, _, lengths = _batch()
    params = AdvantageParams(gamma=1.0, lam=0.95, lam_critic=1.0, length_adaptive_alpha=0.05)
    adv, ret = A.compute_advantages("gae", AdvantageInputs(rewards, mask, values=values), params)
    lam = A.length_adaptive_lambda(lengths, 0.05)
    raw, ret_ref = A.decoupled_gae(rewards, values, mask, 1.0, lam, 1.0)
    torch.testing.assert_close(adv, A.masked_whiten(raw, mask))
    torch.testing.assert_close(ret, ret_ref)
    # lam_critic = 1, gamma = 1 -> Monte-Carlo returns = the outcome score on every token
    torch.testing.assert_close(ret, A.broadcast_to_tokens(torch.tensor([1.0, 0, 1, 1, 0, 0]), mask))


def test_egae_estimator_and_missing_inputs():
    rewards, mask, values, _, _ = _batch()
    truncated = torch.tensor([True, False, False, False, True, False])
    adv, ret = A.compute_advantages(
        "egae", AdvantageInputs(rewards, mask, values=values, truncated=truncated), AdvantageParams(lam=0.9)
    )
    raw, ret_ref = A.compute_egae(rewards, values, mask, truncated, 1.0, 0.9)
    torch.testing.assert_close(adv, A.masked_whiten(raw, mask))
    torch.testing.assert_close(ret, ret_ref)
    with pytest.raises(ValueError, match="truncated"):
        A.compute_advantages("egae", AdvantageInputs(rewards, mask, values=values))
    with pytest.raises(ValueError, match="values"):
        A.compute_advantages("gae", AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="group_index"):
        A.compute_advantages("grpo", AdvantageInputs(rewards, mask))


def test_group_estimators_broadcast_outcome_advantages():
    rewards, mask, _, scores, _ = _batch()
    uid = ["a", "a", "a", "b", "b", "b"]
    adv, ret = A.compute_advantages("grpo", AdvantageInputs(rewards, mask, group_index=uid))
    torch.testing.assert_close(adv, A.broadcast_to_tokens(A.grpo_advantages(scores, uid), mask))
    assert ret is adv
    adv, _ = A.compute_advantages("grpo", AdvantageInputs(rewards, mask, group_index=uid), AdvantageParams(norm_by_std=False))
    # Dr. GRPO: s - mean: group a mean 2/3, group b mean 1/3
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3, -1 / 3]))
    adv, _ = A.compute_advantages("rloo", AdvantageInputs(rewards, mask, group_index=uid))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -1.0, 0.5, 1.0, -0.5, -0.5]))
    adv, _ = A.compute_advantages("reinforce_pp", AdvantageInputs(rewards, mask))
    torch.testing.assert_close(adv, A.reinforce_pp_advantages(rewards, mask, 1.0))
    adv, _ = A.compute_advantages("reinforce_pp_baseline", AdvantageInputs(rewards, mask, group_index=uid))
    torch.testing.assert_close(adv, A.reinforce_pp_advantages(rewards, mask, group_index=uid))
