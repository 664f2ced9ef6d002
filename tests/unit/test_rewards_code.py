"""Code reward: pass rates over stdin/stdout and assert-style tests, run in the sandbox."""

from __future__ import annotations

import json

import pytest

from megarl.rewards.code import CodeRewardParams, code_reward, extract_code, outputs_match, parse_tests
from megarl.rewards.types import RewardError

DOUBLE = "Here is my solution:\n```python\nn = int(input())\nprint(n * 2)\n```\nDone."
STDIN_TESTS = [{"stdin": "3\n", "stdout": "6\n"}, {"input": "5", "output": "10"},
               {"stdin": "1", "stdout": "3"}]  # the last expectation is wrong on purpose


def test_extract_code():
    assert extract_code(DOUBLE) == "n = int(input())\nprint(n * 2)\n"
    two = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```text\nnot code\n```"
    assert extract_code(two) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("no fences at all") is None


def test_outputs_match_is_whitespace_insensitive():
    assert outputs_match("1 2\n3\n\n", "1 2 3")
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("12", "1 2")


def test_stdin_stdout_pass_rate():
    out = code_reward(DOUBLE, parse_tests({"tests": STDIN_TESTS}, None), CodeRewardParams())
    assert out.score == pytest.approx(2 / 3) and out.acc is False
    assert out.info["passed"] == 2 and out.info["total"] == 3
    full = code_reward(DOUBLE, parse_tests({"tests": STDIN_TESTS[:2]}, None), CodeRewardParams())
    assert (full.score, full.acc) == (1.0, True)


def test_all_or_nothing_stops_at_the_first_failure_and_maps_scores():
    tests = parse_tests({"tests": [STDIN_TESTS[2], STDIN_TESTS[0]]}, None)
    params = CodeRewardParams(all_or_nothing=True, correct_score=1.0, incorrect_score=-1.0)
    out = code_reward(DOUBLE, tests, params)
    assert out.score == -1.0 and out.acc is False and len(out.info["statuses"]) == 1


def test_assert_tests_and_early_exit_cheats():
    tests = parse_tests({"tests": [{"assert": "assert add(1, 2) == 3"},
                                   {"assert": "assert add(2, 2) == 5"},
                                   {"assert": "assert add(-1, 1) == 0"}]}, None)
    honest = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_reward(honest, tests, CodeRewardParams()).score == pytest.approx(2 / 3)
    for cheat in ("import os\nos._exit(0)",
                  "import sys\nsys.exit(0)\ndef add(a, b): return 99",
                  "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b): return 99"):
        out = code_reward(f"```python\n{cheat}\n```", tests, CodeRewardParams())
        assert out.score == 0.0, cheat


def test_apps_style_input_output():
    io = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "8\n"]}
    add = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_reward(add, parse_tests({"input_output": json.dumps(io)}, None),
                       CodeRewardParams()).score == 0.5
    call = {"fn_name": "twoSum", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
    leet = "```python\nclass Solution:\n    def twoSum(self, a, b):\n        return a + b\n```"
    out = code_reward(leet, parse_tests({}, json.dumps(call)), CodeRewardParams())
    assert (out.score, out.acc) == (1.0, True)


def test_timeouts_and_crashes_fail_their_cases():
    loop = "```python\nwhile True:\n    pass\n```"
    out = code_reward(loop, parse_tests({"tests": STDIN_TESTS[:1]}, None), CodeRewardParams(timeout_s=1))
    assert out.score == 0.0 and out.info["statuses"] == ["timeout"]


def test_no_code_and_bad_tests():
    out = code_reward("I cannot solve this.", [{"stdin": "", "stdout": ""}], CodeRewardParams())
    assert out.score == 0.0 and out.info["reason"] == "no_code"
    with pytest.raises(RewardError, match="no test cases"):
        parse_tests({"tests": []}, None)
    with pytest.raises(RewardError, match="test case 1"):
        parse_tests({"tests": [{"assert": "assert 1"}, {"stdin": "1"}]}, None)
    with pytest.raises(RewardError, match="not JSON"):
        parse_tests({}, "print(1)")
    with pytest.raises(ValueError):
        CodeRewardParams(timeout_s=0)
