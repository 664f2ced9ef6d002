"""Hybrid routing: config parsing and validation, routing, bounded concurrency, and failures
(exceptions, timeouts, bad outputs, unknown sources) scored and counted without crashing."""

from __future__ import annotations

import math
import threading
import time

import pytest

from megarl.rewards import (
    BuiltReward, RewardConfig, RewardInput, RewardManager, RewardOutput, RewardTimeout,
    register_reward)
from megarl.rewards.registry import REWARDS


def _register(name, factory):
    if name not in REWARDS:
        register_reward(name)(factory)


_concurrency = {"now": 0, "max": 0}
_lock = threading.Lock()


def _tracked(x: RewardInput) -> RewardOutput:
    with _lock:
        _concurrency["now"] += 1
        _concurrency["max"] = max(_concurrency["max"], _concurrency["now"])
    time.sleep(0.05)
    with _lock:
        _concurrency["now"] -= 1
    return RewardOutput(float(len(x.response)), True)


def _behave(x: RewardInput) -> RewardOutput:
    kind = x.response
    if kind == "hang":
        time.sleep(3)
    if kind == "crash":
        raise ValueError("boom")
    if kind == "timeout":
        raise RewardTimeout("too slow")
    if kind == "nan":
        return RewardOutput(math.nan, True)
    if kind == "wrong_type":
        return 1.0  # type: ignore[return-value]
    return RewardOutput(0.25, True)


_register("_test_tracked", lambda params, res: BuiltReward(failure_score=-9.0, sample_fn=_tracked))
_register("_test_behave", lambda params, res: BuiltReward(failure_score=-7.0, sample_fn=_behave))


def test_lead_default_reward_dict_builds():
    cfg = RewardConfig.from_dict({"correct_score": 1.0, "incorrect_score": -1.0})
    assert sorted(cfg.sources) == ["code", "math"]
    assert cfg.params_for("math") == {"correct_score": 1.0, "incorrect_score": -1.0}
    RewardManager(cfg).close()


@pytest.mark.parametrize("bad, message", [
    ({"sorces": {}}, "unknown field"),
    ({"sources": {}}, "non-empty"),
    ({"sources": {"math": {"params": {}}}}, "missing field 'fn'"),
    ({"sources": {"math": {"fn": "math", "weight": 2}}}, r"sources.math: unknown field"),
    ({"sources": {"math": 3}}, "expected a function name"),
    ({"default_source": "code", "sources": {"math": "math"}}, "default_source"),
    ({"max_workers": 0}, "max_workers"),
])
def test_config_errors_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig.from_dict(bad)


@pytest.mark.parametrize("sources, message", [
    ({"x": "no_such_fn"}, r"reward.sources.x: unknown reward function 'no_such_fn'"),
    ({"m": {"fn": "math", "params": {"corect_score": 1}}}, r"reward.sources.m: .*unknown field"),
    ({"g": "genrm"}, r"no judge resource 'judge'"),
])
def test_manager_errors_name_the_source(sources, message):
    with pytest.raises(ValueError, match=message):
        RewardManager(RewardConfig.from_dict({"sources": sources}))


def test_from_yaml(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("reward:\n  incorrect_score: 0.0\n  sources:\n    math: math\n"
                    "    'code*': {fn: code, params: {timeout_s: 2}}\n  default_source: math\n")
    cfg = RewardConfig.from_yaml(path)
    assert cfg.incorrect_score == 0.0 and cfg.sources["code*"].params == {"timeout_s": 2}
    assert [cfg.route(s) for s in ("math", "codeforces", "gsm8k")] == ["math", "code*", "math"]
    path.write_text("reward:\n  bogus: 1\n")
    with pytest.raises(ValueError, match=r"recipe.yaml: reward: unknown field"):
        RewardConfig.from_yaml(path)


def test_mixed_batch_routes_and_counts():
    cfg = RewardConfig.from_dict({"sources": {"math": "math",
                                              "code": {"fn": "code", "params": {"timeout_s": 3}}}})
    batch = [
        RewardInput("math", "q", "Answer: 5", gold="5"),
        RewardInput("math", "q", "Answer: 6", gold="5"),
        RewardInput("math", "q", "Answer: \\dfrac{1}{2}", gold="\\frac{1}{2}"),  # string path
        RewardInput("code", "q", "```python\nprint(int(input()) + 1)\n```",
                    extra={"tests": [{"stdin": "1", "stdout": "2"}]}),
        RewardInput("poetry", "q", "roses"),                       # no route
        RewardInput("math", "q", "Answer: 5", gold=None),           # bad row
    ]
    with RewardManager(cfg) as manager:
        outputs, metrics = manager.score(batch)
    assert [(o.score, o.acc) for o in outputs] == [
        (1.0, True), (-1.0, False), (1.0, True), (1.0, True), (-1.0, False), (-1.0, False)]
    assert "no reward route" in outputs[4].info["failure"]
    assert metrics["reward/count"] == 6 and metrics["reward/failures"] == 2
    assert metrics["reward/timeouts"] == 0 and metrics["reward/correct"] == 3
    assert metrics["reward/score_sum"] == pytest.approx(0.0)
    assert metrics["reward/math/count"] == 4 and metrics["reward/math/failures"] == 1
    assert metrics["reward/code/correct"] == 1


def test_failures_are_scored_counted_and_bounded_in_time():
    cfg = RewardConfig.from_dict({
        "sources": {"b": {"fn": "_test_behave", "timeout_s": 0.5},
                    "b2": {"fn": "_test_behave", "failure_score": 0.0}},
        "max_workers": 8})
    kinds = ["ok", "hang", "crash", "timeout", "nan", "wrong_type"]
    batch = [RewardInput("b", "", k) for k in kinds] + [RewardInput("b2", "", "crash")]
    manager = RewardManager(cfg)
    start = time.monotonic()
    outputs, metrics = manager.score(batch)
    assert time.monotonic() - start < 2.0  # the hanging call is abandoned at its 0.5 s deadline
    assert [o.score for o in outputs] == [0.25, -7.0, -7.0, -7.0, -7.0, -7.0, 0.0]
    assert "deadline" in outputs[1].info["failure"] and "ValueError: boom" in outputs[2].info["failure"]
    assert metrics["reward/failures"] == 6 and metrics["reward/timeouts"] == 2
    assert metrics["reward/b/failures"] == 5 and metrics["reward/b2/failures"] == 1
    manager.close()


def test_stuck_threads_do_not_stall_steps():
    """One worker thread, stuck in a call that ignores its deadline: the queued sample is given
    up on within a bounded time, and the next score() gets a fresh thread pool."""
    cfg = RewardConfig.from_dict({"sources": {"b": {"fn": "_test_behave", "timeout_s": 0.3}},
                                  "max_workers": 1})
    manager = RewardManager(cfg)
    start = time.monotonic()
    outputs, metrics = manager.score([RewardInput("b", "", "hang"), RewardInput("b", "", "ok")])
    assert time.monotonic() - start < 1.5  # 0.3 s x (2 waves + 1)
    assert [o.score for o in outputs] == [-7.0, -7.0] and metrics["reward/timeouts"] == 2
    start = time.monotonic()
    outputs, metrics = manager.score([RewardInput("b", "", "ok")])
    assert outputs[0].score == 0.25 and time.monotonic() - start < 0.5
    manager.close()


def test_global_failure_score_overrides_function_default():
    cfg = RewardConfig.from_dict({"sources": {"b": "_test_behave"}, "failure_score": -0.5})
    with RewardManager(cfg) as manager:
        outputs, _ = manager.score([RewardInput("b", "", "crash")])
    assert outputs[0].score == -0.5


def test_concurrency_is_bounded():
    cfg = RewardConfig.from_dict({"sources": {"t": "_test_tracked"}, "max_workers": 3})
    _concurrency["max"] = 0
    with RewardManager(cfg) as manager:
        outputs, _ = manager.score([RewardInput("t", "", "x" * i) for i in range(12)])
    assert [o.score for o in outputs] == [float(i) for i in range(12)]
    assert 2 <= _concurrency["max"] <= 3


def test_registering_a_name_twice_fails():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(lambda p, r: None)
