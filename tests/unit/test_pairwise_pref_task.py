"""The pairwise_pref quickstart task: the hidden rule (hand-computed), anchors, judge pairs, files."""

import json
import random

import pytest

from megarl.rewards import RewardInput
from megarl.tasks import pairwise_pref as pp


def test_weighted_sum_and_hidden_score_by_hand():
    # S = 3*d0 + 2*d1 + 1*d2 + 0*d3; digits 4179: S(desc 9741) = 27+14+4 = 45, S(asc 1479) = 3+8+7 = 18
    assert pp.weighted_sum("9741") == 45 and pp.weighted_sum("1479") == 18
    assert pp.hidden_score("4179", "9741") == 1.0
    assert pp.hidden_score("4179", "1479") == 0.0
    assert pp.hidden_score("4179", "4179") == pytest.approx((3 * 4 + 2 * 1 + 7 - 18) / 27)  # 1/9
    assert pp.hidden_score("4179", "7941") == pytest.approx((21 + 18 + 4 - 18) / 27)  # 25/27
    assert pp.hidden_score("4179", " 9741\n") == 1.0  # surrounding whitespace is ignored


@pytest.mark.parametrize("response", ["4479", "417", "41790", "9 741", "", "abcd", "9751"])
def test_a_response_that_is_not_an_arrangement_scores_zero(response):
    assert pp.hidden_score("4179", response) == 0.0


def test_prompts_need_distinct_digits():
    with pytest.raises(ValueError, match="distinct digits"):
        pp.hidden_score("4419", "9441")


def test_hidden_rule_reward_reads_the_digits_from_the_answer():
    out = pp.hidden_rule_reward(RewardInput(pp.EVAL_SOURCE, "4179:", "7941", gold="4179"))
    assert out.score == pytest.approx(25 / 27) and out.acc is False and out.info["valid"]
    best = pp.hidden_rule_reward(RewardInput(pp.EVAL_SOURCE, "4179:", "9741", gold="4179"))
    assert best.score == 1.0 and best.acc is True


def test_the_anchor_is_the_arrangement_nearest_half():
    # 4179: hidden score (S - 18) / 27 = 0.5 at S = 31.5; the nearest arrangements have S = 31 or 32
    rng = random.Random(0)
    for _ in range(20):
        a = pp.anchor_response(rng, "4179")
        assert sorted(a) == sorted("4179") and pp.weighted_sum(a) in (31, 32)


def test_judge_pairs_are_labelled_by_the_hidden_rule():
    rng = random.Random(3)
    prompts = ["4179", "0823", "5619"]
    pairs = pp.judge_pairs(rng, prompts, pairs_per_prompt=200, invalid_frac=0.2)
    assert 0 < len(pairs) <= 600
    invalid = 0
    for p in pairs:
        d = pp.digits_of(p["prompt"])
        assert p["prompt"] == d + ":" and d in prompts
        assert pp.hidden_score(d, p["chosen"]) > pp.hidden_score(d, p["rejected"])
        invalid += not pp.is_arrangement(d, p["rejected"])
        assert len(p["chosen"]) == len(p["rejected"]) == 4
    assert 0.1 < invalid / len(pairs) < 0.5  # 1 - 0.8^2 = 36% of draws hold an invalid candidate


def test_invalid_responses_are_never_arrangements():
    rng = random.Random(5)
    assert not any(pp.is_arrangement("4179", pp.invalid_response(rng, "4179")) for _ in range(500))


def test_task_files(tmp_path):
    paths = pp.write_task_files(tmp_path, seed=1)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    assert len(rows["train"]) == pp.SPLITS["train"] and len(rows["eval"]) == pp.SPLITS["eval"]
    train_digits = {r["answer"] for r in rows["train"]}
    eval_digits = {r["answer"] for r in rows["eval"]}
    sft_digits = {pp.digits_of(r["prompt"]) for r in rows["sft"]}
    judge_eval_digits = {pp.digits_of(r["prompt"]) for r in rows["judge_eval"]}
    judge_train_digits = {pp.digits_of(r["prompt"]) for r in rows["judge_train"]}
    for a, b in [(train_digits, eval_digits), (sft_digits, eval_digits), (judge_train_digits, judge_eval_digits),
                 (judge_train_digits, eval_digits), (judge_eval_digits, train_digits)]:
        assert not a & b
    for r in rows["train"]:
        assert r["data_source"] == pp.DATA_SOURCE and r["problem"] == r["answer"] + ":"
        assert pp.is_arrangement(r["answer"], r["reference"])
        assert abs(pp.hidden_score(r["answer"], r["reference"]) - 0.5) < 0.15  # the nearest level to 0.5
    assert all(r["data_source"] == pp.EVAL_SOURCE and "reference" not in r for r in rows["eval"])
    scores = [pp.hidden_score(pp.digits_of(r["prompt"]), r["response"]) for r in rows["sft"]]
    assert all(pp.is_arrangement(pp.digits_of(r["prompt"]), r["response"]) for r in rows["sft"])
    assert 0.45 < sum(scores) / len(scores) < 0.55 and min(scores) == 0.0 and max(scores) == 1.0  # mixed quality
