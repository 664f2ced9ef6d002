"""Code reward: pass rate of the response's program over test cases, run in the sandbox.

Test cases (from `RewardInput.extra["tests"]`, `extra["input_output"]`, or a JSON `gold`):
- stdin/stdout: `{"stdin": "...", "stdout": "..."}` (aliases `input` / `output`); one sandbox
  run per case; outputs match when their whitespace-separated tokens are equal.
- assert-style: `{"assert": "assert add(1, 2) == 3"}`; all of them run in one sandbox run after
  the solution, each reporting success with a per-run random token on stdout, so an early
  `exit(0)` in the solution does not pass them.
- APPS/TACO `input_output`: `{"inputs": [...], "outputs": [...]}` -> stdin/stdout cases; with
  `"fn_name"`, call-based cases `fn_name(*inputs[i]) == outputs[i]` (a `Solution` class method
  if the solution defines one).

Known limit: tests share a process with the solution in the assert-style mode, so a solution
that deliberately reads its own source can forge the tokens; stdin/stdout cases are judged
outside the sandbox and are not forgeable this way.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from megarl.rewards.sandbox import Limits, run_python
from megarl.rewards.types import RewardError, RewardOutput

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last fenced code block tagged python/py/python3 (or untagged), else None."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(response)]
    for lang, body in reversed(blocks):
        if lang in ("python", "py", "python3", ""):
            return body
    return None


@dataclass
class CodeRewardParams:
    """score = incorrect_score + (correct_score - incorrect_score) * pass_rate."""

    timeout_s: float = 5.0  # per sandbox run (each stdin case; all assert cases together)
    memory_mb: int = 512
    all_or_nothing: bool = False  # pass rate 1 if every case passes else 0; stops at the first failure
    max_tests: int | None = None
    correct_score: float = 1.0
    incorrect_score: float = 0.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0:
            raise ValueError(f"code reward: timeout_s and memory_mb must be > 0 (got {self})")


def parse_tests(extra: dict, gold: str | None) -> list[dict]:
    """Normalises the test cases of one sample to `{"stdin", "stdout"}` / `{"assert"}` dicts."""
    raw = extra.get("tests")
    if raw is None and "input_output" in extra:
        raw = extra["input_output"]
    if raw is None and gold:
        try:
            raw = json.loads(gold)
        except json.JSONDecodeError:
            raise RewardError("code sample: no extra['tests'] and gold is not JSON tests") from None
    if isinstance(raw, str):
        raw = json.loads(raw)
    if isinstance(raw, dict) and "inputs" in raw and "outputs" in raw:
        if len(raw["inputs"]) != len(raw["outputs"]):
            raise RewardError("code sample: input_output has different numbers of inputs and outputs")
        fn = raw.get("fn_name")
        if fn:
            return [{"assert": f"assert __megarl_call({fn!r}, {list(args)!r}) == {out!r}"}
                    for args, out in zip(raw["inputs"], raw["outputs"])]
        return [{"stdin": _as_text(i), "stdout": _as_text(o)}
                for i, o in zip(raw["inputs"], raw["outputs"])]
    if not isinstance(raw, list) or not raw:
        raise RewardError("code sample has no test cases")
    cases = []
    for k, case in enumerate(raw):
        if not isinstance(case, dict):
            raise RewardError(f"code sample: test case {k} is not an object")
        if "assert" in case:
            cases.append({"assert": str(case["assert"])})
        elif ("stdin" in case or "input" in case) and ("stdout" in case or "output" in case):
            cases.append({"stdin": _as_text(case.get("stdin", case.get("input"))),
                          "stdout": _as_text(case.get("stdout", case.get("output")))})
        else:
            raise RewardError(f"code sample: test case {k} needs 'assert' or stdin/stdout fields")
    return cases


def _as_text(value) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def outputs_match(got: str, expected: str) -> bool:
    return got.split() == expected.split()


_HARNESS = '''
import sys as __megarl_sys, traceback as __megarl_tb
__megarl_globals = {{"__name__": "__main__"}}
try:
    exec(compile({solution!r}, "solution.py", "exec"), __megarl_globals)
except BaseException:
    __megarl_tb.print_exc()

def __megarl_call(name, args):
    g = __megarl_globals
    target = getattr(g["Solution"](), name) if "Solution" in g and name not in g else g[name]
    return target(*args)

__megarl_globals["__megarl_call"] = __megarl_call
for __megarl_token, __megarl_src in {tests!r}:
    try:
        exec(compile(__megarl_src, "test.py", "exec"), __megarl_globals)
    except BaseException:
        continue
    __megarl_sys.stdout.write("\\n" + __megarl_token + "\\n")
    __megarl_sys.stdout.flush()
'''


def _run_asserts(code: str, tests: list[str], limits: Limits) -> tuple[int, str]:
    tokens = [secrets.token_hex(16) for _ in tests]
    program = _HARNESS.format(solution=code, tests=list(zip(tokens, tests)))
    result = run_python(program, limits=limits)
    lines = set(result.stdout.splitlines())
    return sum(t in lines for t in tokens), result.status


def code_reward(response: str, tests: list[dict], params: CodeRewardParams) -> RewardOutput:
    """Pass rate of the last code block of `response` over `tests` (see parse_tests)."""
    code = extract_code(response)
    if code is None:
        return RewardOutput(params.incorrect_score, False, {"reason": "no_code", "passed": 0,
                                                             "total": len(tests)})
    if params.max_tests is not None:
        tests = tests[: params.max_tests]
    limits = Limits(timeout_s=params.timeout_s, memory_mb=params.memory_mb)
    passed, statuses = 0, []
    for case in (c for c in tests if "stdin" in c):
        result = run_python(code, stdin=case["stdin"], limits=limits)
        ok = result.status == "ok" and outputs_match(result.stdout, case["stdout"])
        passed += ok
        statuses.append(result.status)
        if params.all_or_nothing and not ok:
            break
    asserts = [c["assert"] for c in tests if "assert" in c]
    if asserts and not (params.all_or_nothing and passed < len(statuses)):
        n_ok, status = _run_asserts(code, asserts, limits)
        passed += n_ok
        statuses.append(status)
    rate = passed / len(tests)
    if params.all_or_nothing:
        rate = float(passed == len(tests))
    score = params.incorrect_score + (params.correct_score - params.incorrect_score) * rate
    return RewardOutput(score, passed == len(tests),
                        {"passed": passed, "total": len(tests), "statuses": statuses})
