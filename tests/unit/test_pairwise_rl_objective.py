"""Pairwise-RL in the trainer: the pairwise_genrm reward with its centre (r - 0.5 on the last
token) and the advantages the trainer computes from it (GAE with a critic), by hand and against
megarl.algorithms.pairwise_pag.pairwise_advantages."""

import pytest
import torch

from megarl.algorithms.pairwise_pag import pairwise_advantages, pairwise_reward
from megarl.config import load_config
from megarl.rewards import RewardConfig, RewardInput
from megarl.tasks import pairwise_pref as pp
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import build_rewards

QS = "configs/quickstart/pairwise_rl.yaml"


def _batch(scores: list[float], lengths: list[int]) -> StepBatch:
    trajs = [Trajectory(uid=str(i), prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), rollout_logprobs=[0.0] * n,
                        finish_reason="stop", score=s, data_source=pp.DATA_SOURCE)
             for i, (s, n) in enumerate(zip(scores, lengths))]
    return StepBatch.from_trajectories(trajs)


def _trainer_advantages(cfg, scores, lengths, values):
    batch = _batch(scores, lengths)
    rl.set_masks(batch, cfg)
    batch.values = values * batch.response_mask
    rl.compute_advantages(batch, batch, list(range(len(batch))), cfg, None, 0.0)
    return batch


def test_the_trainer_computes_gae_on_r_minus_half_by_hand():
    cfg = load_config(QS, ["algorithm.whiten_advantages=false"])
    lam = cfg.algorithm.lam_actor
    assert cfg.algorithm.advantage == "gae" and cfg.critic.enable and cfg.algorithm.gamma == 1.0 and lam == 0.95
    # one response of 2 tokens, win probability r = 0.8 -> terminal reward 0.3; V = [0.1, 0.2]
    b = _trainer_advantages(cfg, [0.8 - 0.5], [2], torch.tensor([[0.1, 0.2]]))
    d1 = 0.3 - 0.2  # delta at the last token: r - V(s1)
    d0 = 0.2 - 0.1  # delta at the first token: V(s1) - V(s0)
    assert b.advantages[0].tolist() == pytest.approx([d0 + lam * d1, d1])
    assert b.returns[0].tolist() == pytest.approx([d0 + lam * d1 + 0.1, 0.3])


def test_the_trainer_path_is_pairwise_advantages():
    cfg = load_config(QS, ["algorithm.whiten_advantages=false"])
    p_first = torch.tensor([0.9, 0.2, 0.6, 0.5])
    p_second = torch.tensor([0.3, 0.7, 0.6, 0.5])
    r = pairwise_reward(p_first, p_second)
    lengths = [3, 1, 4, 2]
    values = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    b = _trainer_advantages(cfg, (r - 0.5).tolist(), lengths, values)
    adv, ret = pairwise_advantages(p_first, p_second, values * b.response_mask, b.response_mask,
                                   cfg.algorithm.gamma, cfg.algorithm.lam_actor, centre=0.5)
    torch.testing.assert_close(b.advantages, adv * b.response_mask)
    torch.testing.assert_close(b.returns, ret * b.response_mask)


def test_whitened_advantages_are_the_whitened_pairwise_advantages():
    cfg = load_config(QS)
    assert cfg.algorithm.whiten_advantages
    p_first, p_second = torch.tensor([0.9, 0.2, 0.6]), torch.tensor([0.3, 0.7, 0.1])
    values = torch.full((3, 3), 0.05)
    b = _trainer_advantages(cfg, (pairwise_reward(p_first, p_second) - 0.5).tolist(), [3, 2, 1], values)
    adv, _ = pairwise_advantages(p_first, p_second, values * b.response_mask, b.response_mask, 1.0, 0.95, centre=0.5)
    m = b.response_mask.bool()
    x = adv[m].double()
    want = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)  # megarl whitens with the unbiased variance
    torch.testing.assert_close(b.advantages[m].double(), want, atol=1e-5, rtol=1e-5)


def test_the_preset_routes_rl_rows_to_the_judge_and_eval_rows_to_the_hidden_rule():
    cfg = load_config(QS)
    reward = {k: v for k, v in cfg.reward.items() if k not in ("judge", "judge_train", "judge_path")}
    rcfg = RewardConfig.from_dict(reward)
    assert rcfg.route(pp.DATA_SOURCE) == "pairwise*"
    assert rcfg.sources["pairwise*"].fn == "pairwise_genrm" and rcfg.sources["pairwise*"].params == {"centre": 0.5}
    assert rcfg.route(pp.EVAL_SOURCE) == pp.EVAL_SOURCE


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    d = tmp_path_factory.mktemp("judge") / "model"
    save_tiny_model(d, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=11))
    return d


def test_the_reward_is_the_judges_win_probability_minus_the_centre(judge_dir):
    cfg = load_config(QS, [f"model.hf_path={judge_dir}", f"reward.judge_path={judge_dir}"])
    manager = build_rewards(cfg)
    rows = [RewardInput(pp.DATA_SOURCE, "4179:", "9741", gold="4179", reference="7194"),
            RewardInput(pp.DATA_SOURCE, "0823:", "3028", gold="0823", reference="2830"),
            RewardInput(pp.DATA_SOURCE, "0823:", "3028"),  # no anchor: a failure, scored as parity (0)
            RewardInput(pp.EVAL_SOURCE, "4179:", "7941", gold="4179")]
    outs, metrics = manager.score(rows)
    manager.close()
    assert metrics["reward/failures"] == 1.0
    for out in outs[:2]:
        r = out.info["win_prob"]
        p1, p2 = out.info["probs"]
        assert r == pytest.approx(0.5 * (p1 + 1 - p2)) and out.score == pytest.approx(r - 0.5) and out.acc == (r > 0.5)
    assert outs[2].score == 0.0 and not outs[2].acc
    assert outs[3].score == pytest.approx(25 / 27)  # the eval rows: the hidden rule


def test_the_centre_must_be_a_probability(judge_dir):
    cfg = load_config(QS, [f"model.hf_path={judge_dir}", f"reward.judge_path={judge_dir}",
                           "reward.sources={general: {fn: pairwise_genrm, params: {centre: 2}}}"])
    with pytest.raises(ValueError, match=r"reward.sources.general: .*centre must be a number in \[0, 1\]"):
        build_rewards(cfg)
