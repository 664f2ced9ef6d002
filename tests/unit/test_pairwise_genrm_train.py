"""Judge training data for Pairwise-RL: pair rendering (both orders, labels swapped), the data
builder, and the held-out accuracy, checked against hand-written texts and a real tiny judge."""

import json
import logging

import pytest
import torch

from megarl.config import load_config
from megarl.rewards.genrm import GenerativeJudge, HFNextTokenScorer, JudgeResult, judge_config, pairwise_score
from megarl.tasks.tiny_model import build_byte_tokenizer
from megarl.trainer.genrm_train import (
    judge_train_config, load_pairs, pair_sft_rows, pairwise_accuracy, text_judge)

QS = "configs/quickstart/pairwise_rl.yaml"
QS_JUDGE = {"use_chat_template": False, "pairwise_template": "{prompt} A:{response_a} B:{response_b}",
            "verdict_prefix": "[["}
PAIR = {"prompt": "4179:", "chosen": "9741", "rejected": "1479"}


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    d = tmp_path_factory.mktemp("judge") / "model"
    save_tiny_model(d, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=5))
    return d


def test_each_pair_gives_both_orders_with_the_labels_swapped():
    judge = GenerativeJudge(None, build_byte_tokenizer(), judge_config(QS_JUDGE))
    assert pair_sft_rows([PAIR], judge) == [
        {"prompt": "4179: A:9741 B:1479\n[[", "response": "A]]"},
        {"prompt": "4179: A:1479 B:9741\n[[", "response": "B]]"},
    ]
    custom = GenerativeJudge(None, build_byte_tokenizer(), judge_config({**QS_JUDGE, "pair_labels": ["1", "2"]}))
    assert [r["response"] for r in pair_sft_rows([PAIR], custom, verdict_suffix="")] == ["1", "2"]


def test_the_quickstart_config_renders_the_short_template():
    cfg = load_config(QS)
    rows = pair_sft_rows([PAIR], text_judge(cfg, build_byte_tokenizer()), judge_train_config(cfg).verdict_suffix)
    assert rows[0] == {"prompt": "4179: A:9741 B:1479\n[[", "response": "A]]"}


def test_default_judge_rows_go_through_the_chat_template():
    judge = GenerativeJudge(None, build_byte_tokenizer(), judge_config({}))
    row = pair_sft_rows([PAIR], judge)[1]
    assert row["prompt"].startswith("<|im_start|>user\nYou are an impartial judge.")
    assert row["prompt"].index("[Response A]\n1479") < row["prompt"].index("[Response B]\n9741")
    assert row["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\nVerdict: [[") and row["response"] == "B]]"


def test_a_training_row_is_the_text_the_judge_scores(tiny_judge_dir):
    """The judge's debiased win probability equals one recomputed by hand from the model's
    next-token distribution after each SFT row's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_judge_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_judge_dir).eval()
    judge = GenerativeJudge(None, tok, judge_config(QS_JUDGE), scorer=HFNextTokenScorer(model))
    pairs = [PAIR, {"prompt": "0823:", "chosen": "8320", "rejected": "3028"}]
    a, b = tok.encode("A", add_special_tokens=False)[0], tok.encode("B", add_special_tokens=False)[0]
    expected = []
    rows = pair_sft_rows(pairs, judge)
    for first, second in zip(rows[0::2], rows[1::2]):
        p = []
        for row in (first, second):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tok.encode(row["prompt"], add_special_tokens=False)])).logits[0, -1]
            p.append(float(torch.softmax(logits[[a, b]].double(), -1)[0]))  # P(first response better)
        expected.append(0.5 * (p[0] + 1 - p[1]))
    got = [r.score for r in judge.pairwise([(q["prompt"], q["chosen"], q["rejected"], None) for q in pairs])]
    assert got == pytest.approx(expected, abs=1e-6)
    acc = pairwise_accuracy(judge, pairs)
    assert acc["accuracy"] == sum(e > 0.5 for e in expected) / 2 and acc["pairs"] == 2


class _FirstPositionJudge:
    """A judge that always prefers the response shown first (pure position bias)."""

    def pairwise(self, items):
        return [JudgeResult(pairwise_score(1.0, 1.0), [1.0, 1.0]) for _ in items]


def test_accuracy_of_a_position_biased_judge_is_zero_after_debiasing():
    acc = pairwise_accuracy(_FirstPositionJudge(), [PAIR] * 3)
    assert acc["accuracy"] == 0.0  # r = 0.5 exactly: no preference
    assert acc["accuracy_chosen_first"] == 1.0 and acc["accuracy_chosen_second"] == 0.0
    assert acc["mean_win_prob"] == 0.5


def test_bad_pair_rows_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join([json.dumps(PAIR), "{not json", json.dumps({"prompt": "1:", "chosen": "a"}),
                               json.dumps({**PAIR, "rejected": PAIR["chosen"]}), json.dumps({**PAIR, "chosen": 7})]))
    with caplog.at_level(logging.WARNING):
        assert load_pairs(path) == [PAIR]
    assert "skipped 4 bad pair rows" in caplog.text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pairs(tmp_path / "none.jsonl")


def test_judge_settings_fail_naming_the_field():
    cfg = load_config(QS)
    assert judge_train_config(cfg).steps == cfg.reward["judge_train"]["steps"]
    with pytest.raises(ValueError, match=r"reward.judge_train: unknown field\(s\) \['stepz'\]"):
        judge_train_config(cfg, {"stepz": 3})
    assert judge_train_config(cfg, {"lr": "2e-3", "steps": 3.0}).lr == 0.002  # YAML reads 2e-3 as a string
    with pytest.raises(ValueError, match="reward.judge_train.steps must be a int"):
        judge_train_config(cfg, {"steps": 2.5})
    with pytest.raises(ValueError, match="reward.judge_train.steps must be >= 1"):
        judge_train_config(cfg, {"steps": 0})
    with pytest.raises(ValueError, match=r"reward.judge: unknown field\(s\) \['templet'\]"):
        judge_config({"templet": "x"}, "reward.judge")
    with pytest.raises(ValueError, match="reward.judge.pair_labels must be two strings"):
        judge_config({"pair_labels": ["A"]}, "reward.judge")
    with pytest.raises(ValueError, match="reward.judge: JudgeConfig.pairwise_template lacks"):
        judge_config({"pairwise_template": "{prompt} {response_a}"}, "reward.judge")
