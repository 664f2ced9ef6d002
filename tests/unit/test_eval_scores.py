"""megarl eval's statistics (megarl.evaluate.scores) against hand-computed values."""

import pytest

from megarl.evaluate.cli import without_nproc
from megarl.evaluate.scores import SampleResult, majority_correct, pass_at_k, summarize


def s(uid, acc, answer=None, length=10, truncated=False, score=None):
    return SampleResult(uid, acc, float(acc) if score is None else score, answer, length, truncated)


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 3, 3) == 1.0 and pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 2 wrong < k=3; 1 - 1/10
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_majority_vote_takes_the_most_common_answer_first_seen_on_ties():
    assert majority_correct([s("a", False, "3"), s("a", True, "4"), s("a", False, "3")]) is False
    assert majority_correct([s("a", True, "4"), s("a", False, "3"), s("a", False, None), s("a", False, None)])
    assert majority_correct([s("a", False, "3"), s("a", True, "4")]) is False  # tie: "3" came first
    assert majority_correct([s("a", False, None)]) is False  # no answer, no vote


def test_summary_of_a_set():
    results = [s("p1", True, "2", 4), s("p1", False, "3", 8, True), s("p1", True, "2", 6), s("p1", False, "5", 2),
               s("p2", False, None, 10, True), s("p2", False, "7", 10), s("p2", False, "7", 10), s("p2", False, "1", 10)]
    out = summarize(results)
    assert out["prompts"] == 2 and out["n"] == 4
    assert out["avg@4"] == pytest.approx((2 / 4 + 0) / 2)
    assert out["pass@1"] == pytest.approx(out["avg@4"])
    assert out["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # p1: 1 - C(2,2)/C(4,2)
    assert out["pass@4"] == pytest.approx(0.5) and out["maj@4"] == pytest.approx(0.5)
    assert out["response_length"] == pytest.approx(60 / 8) and out["truncated"] == pytest.approx(2 / 8)
    assert out["score"] == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="different numbers of samples"):
        summarize(results[:-1])


def test_nproc_is_not_passed_to_torchrun():
    assert without_nproc(["--nproc", "2", "--hf", "x", "--nproc=3", "a=b"]) == ["--hf", "x", "a=b"]


def test_bad_model_arguments_are_clear_errors(tmp_path, capsys):
    from megarl.evaluate.cli import main

    assert main(["--data", "x.jsonl"]) == 2
    assert "give --hf HF_DIR or --ckpt CHECKPOINT" in capsys.readouterr().err
    assert main(["--hf", str(tmp_path), "--data", "x.jsonl"]) == 2
    assert "is not an HF model directory (no config.json)" in capsys.readouterr().err
    assert main(["--ckpt", str(tmp_path), "--data", "x.jsonl"]) == 2
    assert "is not a megarl model checkpoint" in capsys.readouterr().err
