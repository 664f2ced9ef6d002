"""Arithmetic quickstart task, byte-level tokenizer and the tiny Qwen2 model maker."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.data import apply_template, load_prompt_dataset
from megarl.tasks.arith import cot_response, extract_answer, make_problem, write_task_files
from megarl.tasks.tiny_model import TinyModelSpec, build_byte_tokenizer, save_tiny_model

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(\d)\+(\d)\+([01])=(\d+) (\d+)$")


def test_cot_hand_examples():
    assert cot_response(347, 85) == "7+5+0=12 2\n4+8+1=13 32\n3+0+1=4 432\nAnswer: 432"
    assert cot_response(999, 1) == "9+1+0=10 0\n9+0+1=10 00\n9+0+1=10 1000\nAnswer: 1000"
    assert cot_response(9, 4) == "9+4+0=13 13\nAnswer: 13"
    assert cot_response(0, 0) == "0+0+0=0 0\nAnswer: 0"
    assert extract_answer(cot_response(347, 85)) == "432"
    assert extract_answer("7+5+0=12") is None


def check_cot(prompt: str, answer: str, cot: str) -> None:
    """Independent re-derivation: every column line is a correct digit sum with the right carry."""
    a, b = map(int, re.fullmatch(r"Q: (\d+)\+(\d+)=\?\n", prompt).groups())
    assert int(answer) == a + b
    *cols, last = cot.split("\n")
    assert last == f"Answer: {a + b}"
    assert len(cols) == max(len(str(a)), len(str(b)))
    carry, digits = 0, []
    for k, line in enumerate(cols):
        x, y, c, s, so_far = LINE.fullmatch(line).groups()
        x, y, c, s = int(x), int(y), int(c), int(s)
        assert (x, y, c) == ((a // 10**k) % 10, (b // 10**k) % 10, carry)
        assert s == x + y + c
        digits.append(s % 10)
        carry = s // 10
        tail = "".join(map(str, digits[::-1]))  # the answer digits found so far
        assert so_far == (str(s) + tail[1:] if k == len(cols) - 1 else tail)
    assert int("".join(map(str, ([carry] if carry else []) + digits[::-1]))) == a + b


def test_make_problem_cots_are_correct_arithmetic():
    rng = random.Random(0)
    for digits in (1, 3, 5):
        for _ in range(200):
            check_cot(*make_problem(rng, digits))


def test_task_files_disjoint_and_loadable(tmp_path):
    paths = write_task_files(tmp_path, n_sft=300, n_train=200, n_eval=100, seed=1, digits=3)
    rows = {k: [json.loads(l) for l in p.read_text().splitlines()] for k, p in paths.items()}
    assert {k: len(v) for k, v in rows.items()} == {"sft": 300, "train": 200, "eval": 100}
    problems = {k: {r["problem"] for r in v} for k, v in rows.items()}
    assert sum(map(len, problems.values())) == 600  # unique within and across splits
    for r in rows["sft"]:
        assert r["prompt"] == apply_template("arith", r["problem"])
        check_cot(r["prompt"], r["answer"], r["response"])
    ds = load_prompt_dataset(paths["train"])
    assert len(ds) == 200 and not ds.skipped and {it.data_source for it in ds} == {"arith"}
    assert all(str(sum(map(int, it.prompt.split("+")))) == it.answer for it in ds)
    with pytest.raises(ValueError, match="distinct new problems"):
        write_task_files(tmp_path / "small", n_sft=90, n_train=10, n_eval=10, seed=0, digits=1)


def test_reward_accepts_reference_cot():
    from megarl.rewards.math import is_correct

    cot = cot_response(347, 85)
    assert is_correct(cot, "432")
    assert not is_correct(cot, "433")
    assert not is_correct(cot.replace("Answer: 432", "Answer: 431"), "432")


def test_byte_tokenizer_round_trip():
    tok = build_byte_tokenizer()
    rng = random.Random(2)
    texts = [apply_template("arith", "347+85") + cot_response(347, 85), apply_template("dapo", "Find $x^2$ if x=3."),
             "  leading spaces\n\n\ttabs, unicode: é ∑ 𝔸"]
    texts += [p + c for p, _, c in (make_problem(rng, 3) for _ in range(20))]
    for s in texts:
        ids = tok(s)["input_ids"]
        assert tok.decode(ids) == s
    assert tok("Q: 1+2=?\n")["input_ids"] == list(b"Q: 1+2=?\n")  # one token per ASCII char
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 256


def test_saved_model_loads_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=3)
    save_tiny_model(tmp_path / "m", spec)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 320 and len(tok) == 259
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (2, 64, 2)
    assert model.generation_config.eos_token_id == tok.eos_token_id == 256
    s = "Q: 12+5=?\n2+5+0=7"
    assert tok.decode(tok(s)["input_ids"]) == s
    assert tok.chat_template and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    # same seed -> same weights; different seed -> different weights
    save_tiny_model(tmp_path / "m2", spec)
    save_tiny_model(tmp_path / "m3", TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=4))
    w = lambda d: AutoModelForCausalLM.from_pretrained(d).model.embed_tokens.weight
    assert torch.equal(w(tmp_path / "m"), w(tmp_path / "m2"))
    assert not torch.equal(w(tmp_path / "m"), w(tmp_path / "m3"))
    out = model(input_ids=torch.tensor([tok(s)["input_ids"]])).logits
    assert out.shape == (1, len(s), 320) and torch.isfinite(out).all()


def test_reloaded_tokenizer_gives_the_byte_tokenizer_ids(tmp_path):
    """megarl loads the saved directory with AutoTokenizer (a Qwen2Tokenizer under transformers
    5.x); on NFC text it must give the in-memory byte tokenizer's ids, special tokens included."""
    from transformers import AutoTokenizer

    built = build_byte_tokenizer()
    save_tiny_model(tmp_path / "m", TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                                  intermediate=64), tokenizer=built)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "m")
    rng = random.Random(5)
    texts = [p + c for p, _, c in (make_problem(rng, 3) for _ in range(20))]
    texts += [apply_template("arith", "347+85") + cot_response(347, 85),
              "  it's 'll  \r\n\t tabs, unicode: é ∑ 𝔸 <|im_start|>x<|im_end|><|endoftext|>"]
    for s in texts:
        ids = built(s)["input_ids"]
        assert loaded(s)["input_ids"] == ids
        assert loaded.decode(ids) == s
    chat = [{"role": "user", "content": texts[0]}]
    assert loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        built.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert loaded.all_special_ids == built.all_special_ids == [256, 257, 258]
    assert (loaded.eos_token_id, loaded.pad_token_id) == (256, 256)


def test_cli_writes_model_and_task(tmp_path):
    cmd = [sys.executable, "-m", "tools.make_tiny_model", "--out", str(tmp_path / "m"), "--layers", "1",
           "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--tie-word-embeddings",
           "--task-dir", str(tmp_path / "t"), "--n-sft", "20", "--n-train", "10", "--n-eval", "5"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, cwd=REPO)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is True
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert len((tmp_path / "t" / "eval.jsonl").read_text().splitlines()) == 5
