"""GenRM sources get a judge model, and the anchor (reference) response of a data row reaches it."""

import json

import pytest

from megarl.config import load_config
from megarl.data.dataset import load_prompt_dataset
from megarl.rewards import RewardInput
from megarl.trainer.build import build_rewards


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    d = tmp_path_factory.mktemp("judge") / "model"
    save_tiny_model(d, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=3,
                                     max_position_embeddings=1024))
    return d


def test_genrm_sources_are_scored_by_a_judge_built_from_reward_judge_path(judge_dir, caplog):
    cfg = load_config(None, [f"model.hf_path={judge_dir}", "reward.sources={general: pairwise_genrm, chat: genrm}",
                             f"reward.judge_path={judge_dir}"])
    manager = build_rewards(cfg)
    outs, metrics = manager.score([
        RewardInput("general", "Say hi", "hi", reference="hello"),  # anchored: the judge compares
        RewardInput("general", "Say hi", "hi"),  # pairwise-RL without an anchor: a counted failure
        RewardInput("chat", "Say hi", "hi"),  # pointwise
    ])
    manager.close()
    assert metrics["reward/count"] == 3
    for out in outs:  # a random tiny judge: a score in [0, 1], or the GenRM failure score 0.5
        assert 0.0 <= out.score <= 1.0
    anchor_errors = [r.getMessage() for r in caplog.records if "needs an anchor" in r.getMessage()]
    assert len(anchor_errors) == 1 and "sample 1" in anchor_errors[0]


def test_a_missing_judge_fails_at_start_up_naming_the_field(tmp_path):
    cfg = load_config(None, ["reward.sources={general: genrm}", f"reward.judge_path={tmp_path / 'none'}"])
    with pytest.raises(FileNotFoundError, match="reward.judge_path"):
        build_rewards(cfg)


def test_rows_carry_their_reference_response(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"problem": "q", "answer": "1", "anchor": "the best answer"}) + "\n"
                    + json.dumps({"problem": "r", "answer": "2", "anchor": 7}) + "\n")
    ds = load_prompt_dataset(path, reference_key="anchor")
    assert [it.reference for it in ds] == ["the best answer"] and ds.skipped[0][0] == 2
    assert "anchor" in ds.skipped[0][1]
