"""Bad-input corpus: every kind of bad input a user can feed megarl gets a clear error naming the
file / row / field, or a counted skip; nothing is silently wrong.

Data rows (megarl.data): malformed JSON, missing fields, wrong types, empty prompts, prompts over
data.max_prompt_len, non-UTF-8 bytes. Rewards (megarl.rewards.RewardManager, with reward
functions given by dotted path to this module): NaN / inf scores, functions that raise, hang or
return the wrong type. Files: a truncated safetensors file, a model directory without a
tokenizer. Config: bad values and bad combinations. (A checkpoint of another model and a
truncated torch_dist shard: test_bad_input_checkpoint.py.)
"""

from __future__ import annotations

import json
import logging
import math
import time

import pytest

from megarl.config import ConfigError, load_config
from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
from megarl.rewards import RewardConfig, RewardInput, RewardManager, RewardOutput

HERE = "tests.unit.test_bad_input"


def _jsonl(path, lines: list[bytes | str]):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


GOOD = json.dumps({"problem": "1 + 1 =", "answer": "2"})


# ---- data rows ---------------------------------------------------------------------------------
def _skips(tmp_path, caplog, bad_row: bytes | str) -> tuple[list, str]:
    """Loads [good, bad, good] and returns the skips and the warning text."""
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, bad_row, GOOD.replace("1 + 1", "2 + 2")])
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = load_prompt_dataset(path)
    assert len(ds) == 2
    return ds.skipped, caplog.text


def test_malformed_json_row_is_skipped_and_named(tmp_path, caplog):
    row = '{"problem": "3 + 3 =", "answer": '  # cut off: the value is missing at the end of the line
    skipped, warning = _skips(tmp_path, caplog, row)
    assert skipped == [(2, f"invalid JSON (Expecting value at column {len(row) + 1})")]
    assert f"prompt dataset {tmp_path / 'train.jsonl'}: skipped 1 bad row(s) of 3 (row 2: invalid JSON" in warning


def test_missing_field_is_skipped_and_named(tmp_path, caplog):
    skipped, warning = _skips(tmp_path, caplog, json.dumps({"problem": "3 + 3 ="}))
    assert skipped == [(2, "missing field 'answer'")] and "row 2: missing field 'answer'" in warning


def test_wrong_type_fields_are_skipped_and_named(tmp_path, caplog):
    rows = [json.dumps({"problem": 7, "answer": "2"}), json.dumps({"problem": "x =", "answer": [2]}),
            json.dumps([1, 2]), json.dumps({"problem": "x =", "answer": "2", "data_source": 3})]
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, *rows])
    ds = load_prompt_dataset(path)
    assert ds.skipped == [(2, "field 'problem' is a int, not a string"),
                          (3, "field 'answer' is a list, not a string"),
                          (4, "row is a JSON list, not an object"),
                          (5, "field 'data_source' must be a non-empty string, got 3")]


def test_empty_prompt_is_skipped_and_named(tmp_path, caplog):
    skipped, warning = _skips(tmp_path, caplog, json.dumps({"problem": "  \n ", "answer": "2"}))
    assert skipped == [(2, "field 'problem' is empty")] and "row 2: field 'problem' is empty" in warning


def test_prompt_longer_than_the_limit_is_counted_and_named(tmp_path, caplog):
    from megarl.tasks.tiny_model import build_byte_tokenizer

    long_problem = "9" * 40
    long_row = json.dumps({"id": "long-1", "problem": long_problem, "answer": "9"})
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, long_row])
    tok = build_byte_tokenizer()
    n_long = len(tok.encode(long_problem, add_special_tokens=False))  # template raw: the problem itself
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = tokenize_dataset(load_prompt_dataset(path), tok, template="raw", max_prompt_len=20)
    assert n_long == 40 and ds.too_long == [("long-1", 40)] and [it.uid for it in ds] == ["train:1"]
    assert "skipped 1 prompt(s) longer than max_prompt_len=20: long-1 (40 tokens)" in caplog.text


def test_non_utf8_bytes_are_skipped_and_named(tmp_path, caplog):
    skipped, warning = _skips(tmp_path, caplog, b'{"problem": "caf\xe9 =", "answer": "1"}')
    assert skipped == [(2, "invalid UTF-8 at byte 16")] and "row 2: invalid UTF-8 at byte 16" in warning


# ---- reward functions (dotted paths to these) -----------------------------------------------------
def nan_reward(x: RewardInput) -> float:
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x.response, 1.0)


def raising_reward(x: RewardInput) -> RewardOutput:
    raise KeyError(f"no verifier for {x.prompt!r}")


def hanging_reward(x: RewardInput) -> RewardOutput:
    time.sleep(2.0)
    return RewardOutput(1.0, True)


def wrong_type_reward(x: RewardInput):
    return {"str": "1.0", "none": None, "score_str": RewardOutput("high", True)}[x.response]  # type: ignore[arg-type]


def _score(fn: str, responses: list[str], caplog, **spec):
    cfg = RewardConfig.from_dict({"sources": {"src": {"fn": f"{HERE}:{fn}", **spec}}, "failure_score": -1.0})
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.manager"), RewardManager(cfg) as manager:
        return manager.score([RewardInput("src", f"p{i}", r) for i, r in enumerate(responses)])


def test_nan_and_inf_rewards_are_failures_counted_and_named(caplog):
    outputs, metrics = _score("nan_reward", ["ok", "nan", "inf", "-inf"], caplog)
    assert [o.score for o in outputs] == [1.0, -1.0, -1.0, -1.0]
    assert metrics["reward/failures"] == 3 and metrics["reward/src/failures"] == 3 and metrics["reward/timeouts"] == 0
    assert "invalid reward output RewardOutput(score=nan" in outputs[1].info["failure"]
    assert "reward failure: sample 2 (data_source='src', route='src'): invalid reward output " \
           "RewardOutput(score=inf" in caplog.text


def test_reward_function_that_raises_is_a_counted_failure(caplog):
    outputs, metrics = _score("raising_reward", ["a", "b"], caplog)
    assert [o.score for o in outputs] == [-1.0, -1.0] and metrics["reward/failures"] == 2
    assert outputs[0].info["failure"] == "KeyError: \"no verifier for 'p0'\""
    assert "sample 1 (data_source='src', route='src'): KeyError" in caplog.text


def test_reward_function_that_hangs_is_abandoned_and_counted(caplog):
    start = time.monotonic()
    outputs, metrics = _score("hanging_reward", ["a"], caplog, timeout_s=0.3)
    assert time.monotonic() - start < 1.5  # the 2 s call is abandoned at its 0.3 s deadline
    assert outputs[0].score == -1.0 and metrics["reward/timeouts"] == 1 and metrics["reward/failures"] == 1
    assert outputs[0].info["failure"] == "manager deadline 0.3s exceeded"
    assert "reward 'src': abandoned a call running for more than 0.3s" in caplog.text


def test_reward_function_returning_the_wrong_type_is_a_counted_failure(caplog):
    outputs, metrics = _score("wrong_type_reward", ["str", "none", "score_str"], caplog)
    assert [o.score for o in outputs] == [-1.0, -1.0, -1.0] and metrics["reward/failures"] == 3
    expected = "RewardError: custom reward returned {}; expected RewardOutput or a float"
    assert outputs[0].info["failure"] == expected.format("str")
    assert outputs[1].info["failure"] == expected.format("NoneType")
    assert outputs[2].info["failure"].startswith("invalid reward output RewardOutput(score='high'")


# ---- files -------------------------------------------------------------------------------------------
def _tiny_hf(path):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    return save_tiny_model(path, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=0))


def test_truncated_safetensors_file_names_the_file(tmp_path):
    from megarl.weights.hf_reader import CheckpointError, HFCheckpoint

    model = _tiny_hf(tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=rf"{weights}"):
        ckpt = HFCheckpoint(model)
        for name in sorted(ckpt.names()):
            ckpt.read(name)


def test_missing_tokenizer_names_the_model_directory(tmp_path):
    from megarl.trainer.build import TOKENIZER_FILES, load_hf_config_and_tokenizer

    model = _tiny_hf(tmp_path / "model")
    load_hf_config_and_tokenizer(str(model))  # complete: loads
    for name in TOKENIZER_FILES + ("tokenizer_config.json",):
        (model / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=rf"model.hf_path: {model} has no tokenizer \(none of tokenizer.json"):
        load_hf_config_and_tokenizer(str(model))


# ---- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field, text", [
    (["rollout.top_p=1.5"], "rollout.top_p", "must be in (0, 1], got 1.5"),
    (["parallel.collective_timeout_s=0"], "parallel.collective_timeout_s", "must be > 0 seconds"),
    (["trainer.total_steps=many"], "trainer.total_steps", "int"),
    (["trainer.save_intervall=5"], "trainer.save_intervall", "save_interval"),
    (["algorithm.advantage=gae"], "critic.enable", "needs a critic"),
    (["rollout.prompts_per_step=8", "rollout.gen_batch_prompts=4"], "rollout.gen_batch_prompts", "must be >= "
     "rollout.prompts_per_step (8), got 4"),
    (["rollout.prompts_per_step=3", "rollout.n_samples_per_prompt=3", "algorithm.mini_batch_size=4"],
     "algorithm.mini_batch_size", "must divide the rollout batch"),
])
def test_bad_config_values_and_combinations_name_the_field(overrides, field, text):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value) and text in str(e.value), str(e.value)
