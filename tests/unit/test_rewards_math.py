"""Math verifier: extraction, normalisation, equivalence, near-misses, self-verification of the
shipped MATH-500 / AIME 2024 golds, the DAPO reward values, and hard time limits."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megarl.rewards.math import MathRewardParams, check, is_correct, math_reward
from megarl.rewards.math_answer import as_integer, extract_answer, last_boxed, normalize
from megarl.rewards.math_pool import VerifyPool
from megarl.rewards.types import RewardError, RewardTimeout

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def pool():
    p = VerifyPool(size=2)
    p.warmup()
    yield p
    p.close()


def _golds(name: str) -> list[str]:
    return [json.loads(line)["answer"] for line in (DATA / name).read_text().splitlines()]


# ----------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("response, expected", [
    ("Some work.\nAnswer: 42", "42"),
    ("Answer: 3\nthen I changed my mind\nAnswer: 7", "7"),
    ("**Answer:** $\\frac{1}{2}$", "$\\frac{1}{2}$"),
    ("final answer: \\boxed{12}", "12"),
    ("so \\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
    ("nested \\boxed{\\left\\{ 1, \\{2\\} \\right\\}}", "\\left\\{ 1, \\{2\\} \\right\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5.", "5."),
    ("Answer: 3 ... wait, it is \\boxed{5}", "5"),      # the later marker wins
    ("\\boxed{5} so\nAnswer: 6", "6"),
    ("no marker here, it is 5", None),
    ("Answer:   \n", None),
    ("unbalanced \\boxed{1 + {2}", None),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_last_boxed_positions():
    text = "\\boxed{1} and \\fbox{2} and \\boxed{3}"
    assert last_boxed(text) == (text.rindex("\\boxed"), "3")


@pytest.mark.parametrize("raw, expected", [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\dfrac{17}{50}", "\\frac{17}{50}"),
    ("10,\\!080", "10,080"),
    ("90^\\circ", "90"),
    ("864 \\mbox{ inches}^2", "864"),
    ("\\text{(C)}", "C"),
    ("x \\in [-2,7]", "[-2,7]"),
    ("\\$32,\\!348", "32,348"),
    ("\\pi r^2", "\\pi r^2"),                      # space between a command and a variable kept
    ("\\begin{pmatrix} -2 \\\\ 5 \\end{pmatrix}", "\\begin{pmatrix}-2\\\\5\\end{pmatrix}"),
    ("The answer is 5.", "5"),
    ("12 red marbles", "12"),
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_as_integer():
    assert as_integer("-17") == -17
    assert as_integer("11,111,111,100") == 11111111100
    assert as_integer("1,2") is None and as_integer("1.0") is None and as_integer("x") is None


# ----------------------------------------------------------------------------- equivalence

EQUIVALENT = [
    ("Answer: 1/2", "\\frac{1}{2}"),
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("\\boxed{\\frac34}", "\\dfrac{3}{4}"),
    ("Answer: \\frac{3}{4}", "0.75"),
    ("Answer: 1.250", "1.25"),
    ("Answer: 5.0", "5"),
    ("Answer: 3\\sqrt5", "3 \\sqrt{5}"),
    ("Answer: x^2+1", "1 + x^2"),
    ("Answer: 10 cm", "10"),
    ("Answer: $5$ apples", "5"),
    ("Answer: 18.9", "\\$18.90"),
    ("Answer: 90 degrees", "90^\\circ"),
    ("Answer: [2, 5)", "[2,5)"),
    ("Answer: (-\\infty,3]", "(-\\infty, 3]"),
    ("Answer: (0, 9)\\cup(9, 36)", "(0,9) \\cup (9,36)"),
    ("Answer: 5, 3", "3, 5"),
    ("Answer: 1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}"),
    ("Answer: C", "\\text{(C)}"),
    ("Answer: 10,080", "10080"),
    ("Answer: x = 5", "5"),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}"),
    ("Answer: 137.5", "137 \\frac{1}{2}"),
    ("so the result is \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt3}{2}"),
]

NEAR_MISSES = [
    ("Answer: 0.51", "\\frac{1}{2}"),
    ("Answer: (2,5)", "[2,5)"),
    ("Answer: -5", "5"),
    ("Answer: 3", "3, 5"),
    ("Answer: x^2-1", "x^2+1"),
    ("Answer: 100", "10"),
    ("Answer: 2", "\\frac{1}{2}"),
    ("Answer: 2\\sqrt{3}", "2\\sqrt{2}"),
    ("Answer: 5x", "5"),
    ("Answer: D", "\\text{(C)}"),
    ("Answer: \\frac{\\pi}{6}", "-\\frac{\\pi}{6}"),
    ("Answer: 3.2", "3.21"),
    ("I believe it is 5", "5"),                    # no final-answer marker
    ("\\boxed{5}\nAnswer: 4", "5"),                 # the last marker is what counts
]


@pytest.mark.parametrize("response, gold", EQUIVALENT)
def test_equivalent_forms_are_correct(response, gold, pool):
    assert check(response, gold, pool=pool).correct, (response, gold)


@pytest.mark.parametrize("response, gold", NEAR_MISSES)
def test_near_misses_are_rejected(response, gold, pool):
    assert not check(response, gold, pool=pool).correct, (response, gold)


def test_integer_fast_path_needs_no_worker():
    empty = VerifyPool(size=1)  # never started: a check reaching it would spawn a worker
    verdicts = [check(r, g, pool=empty) for r, g in
                [("Answer: 204", "204"), ("Answer: 1,450,000", "1450000"), ("Answer: 25", "204")]]
    assert [v.correct for v in verdicts] == [True, True, False]
    assert {v.method for v in verdicts} <= {"string", "integer"}
    assert empty._idle.get_nowait() is None  # the worker slot was never filled


@pytest.mark.parametrize("name", ["math500.jsonl", "aime2024.jsonl"])
def test_every_gold_self_verifies_in_both_formats(name, pool):
    golds = _golds(name)
    assert len(golds) == {"math500.jsonl": 500, "aime2024.jsonl": 30}[name]
    for gold in golds:
        for response in (f"Let me think.\nAnswer: {gold}", f"So the result is $\\boxed{{{gold}}}$."):
            assert check(response, gold, pool=pool).correct, (name, gold, response)


def test_math_verify_itself_accepts_every_non_integer_gold(pool):
    """The library path (not the string fast path): each normalised gold against itself."""
    golds = [g for g in _golds("math500.jsonl") if as_integer(normalize(g)) is None]
    assert len(golds) > 150
    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(lambda g: pool.verify(normalize(g), normalize(g), 5.0), golds))
    assert all(results), [g for g, ok in zip(golds, results) if not ok]


# ----------------------------------------------------------------------------- reward

def test_dapo_reward_values_and_acc(pool):
    params = MathRewardParams()  # DAPO: +1 / -1
    right = math_reward("Answer: 34", "34", params, pool=pool)
    wrong = math_reward("Answer: 35", "34", params, pool=pool)
    none = math_reward("no answer at all", "34", params, pool=pool)
    assert (right.score, right.acc) == (1.0, True)
    assert (wrong.score, wrong.acc) == (-1.0, False)
    assert (none.score, none.acc, none.info["method"]) == (-1.0, False, "no_answer")
    custom = MathRewardParams(correct_score=1.0, incorrect_score=0.0)
    assert math_reward("Answer: 35", "34", custom, pool=pool).score == 0.0
    with pytest.raises(RewardError):
        math_reward("Answer: 1", None, params, pool=pool)
    with pytest.raises(ValueError):
        MathRewardParams(timeout_s=0)


def test_is_correct_public_api():
    assert is_correct("Answer: 25", "25") and not is_correct("Answer: 26", "25")


# ----------------------------------------------------------------------------- time limits

STALL = "Answer: 2^{9^{9^9}}"  # sympy stalls comparing this tower with 2


def test_soft_timeout_from_a_worker_thread(pool):
    """math-verify's own alarm fires inside the worker even though we call from a thread."""
    box, restarts = {}, pool.restarts

    def run():
        start = time.monotonic()
        try:
            check(STALL, "2", timeout_s=4.0, pool=pool)  # alarm at 3 s, kill at 4 s
        except RewardTimeout as e:
            box["err"] = e
        box["elapsed"] = time.monotonic() - start

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert isinstance(box.get("err"), RewardTimeout)
    assert box["elapsed"] < 4.5 and pool.restarts == restarts  # the worker survived


def test_hard_deadline_kills_and_restarts_the_worker(pool):
    before = pool.restarts
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as ex:
        fut = ex.submit(check, STALL, "2", timeout_s=0.5, pool=pool)
        with pytest.raises(RewardTimeout):
            fut.result(timeout=10)
    assert time.monotonic() - start < 2.0
    assert pool.restarts == before + 1
    assert check("Answer: \\frac{2}{4}", "0.5", pool=pool).correct  # the pool still works


def test_a_worker_that_cannot_start_says_why_and_is_retried(tmp_path, monkeypatch):
    """A failed start raises RewardError with the worker's own error every time (the dead worker
    is not put back for the next call to write into), and the pool recovers once it can start."""
    from megarl.rewards import math_pool

    broken = tmp_path / "worker.py"
    broken.write_text("raise ImportError('no module named math_verify (planted)')\n")
    good = math_pool._WORKER
    monkeypatch.setattr(math_pool, "_WORKER", broken)
    p = VerifyPool(size=1)
    for _ in range(2):
        with pytest.raises(RewardError, match="failed to start.*planted"):
            p.verify("1/2", "0.5", timeout_s=5.0)
    with pytest.raises(RewardError, match="planted"):
        p.warmup()
    monkeypatch.setattr(math_pool, "_WORKER", good)
    assert p.verify("1/2", "0.5", timeout_s=30.0) is True
    p.close()


def test_the_worker_imports_through_pythonpath(tmp_path, monkeypatch):
    """Packages that reach this process through PYTHONPATH (pip --target installs, containers)
    reach the worker too: a planted math_verify that calls every pair equal shadows the real one."""
    fake = tmp_path / "math_verify"
    fake.mkdir()
    (fake / "__init__.py").write_text("def parse(s, **kw):\n    return [s]\n\n\n"
                                      "def verify(a, b, **kw):\n    return True\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    p = VerifyPool(size=1)
    try:
        assert p.verify("1", "2", timeout_s=30.0) is True  # the real math-verify says False
    finally:
        p.close()
