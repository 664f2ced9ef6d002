"""Prompt dataset loading (bad rows skipped and counted), templates, tokenisation filter."""

import json
import logging

from pathlib import Path

import pytest

from megarl.data import (PromptItem, TEMPLATES, apply_template, load_prompt_dataset, render_prompt,
                         tokenize_dataset)
from megarl.tasks.tiny_model import build_byte_tokenizer


def write_lines(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def row(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_jsonl_bad_rows_skipped_and_counted(tmp_path, caplog):
    f = write_lines(tmp_path / "p.jsonl", [
        row(id="a", problem="1+1?", answer="2"),                     # 1 ok
        b'{"id": "b", "problem": "x", "answer": ',                   # 2 invalid JSON
        b'{"id": "c", "problem": "caf\xe9", "answer": "1"}',          # 3 invalid UTF-8 (latin-1 byte)
        row(id="d", answer="3"),                                     # 4 missing problem
        row(id="e", problem="q", answer=""),                         # 5 empty answer
        row(id="f", problem=["not", "str"], answer="1"),             # 6 non-string prompt
        b"",                                                         # blank line: ignored
        row(id="g", problem="q7", answer=7, data_source="gsm8k", level=3),  # 8 ok, int answer
        b"[1, 2]",                                                   # 9 not an object
        row(id="a", problem="dup", answer="1"),                      # 10 duplicate id
        row(problem="no id", answer=" 5 "),                          # 11 ok, generated uid
        row(id="h", problem="q", answer="1", data_source=3),         # 12 bad source
    ])
    with caplog.at_level(logging.WARNING):
        ds = load_prompt_dataset(f)
    assert [it.uid for it in ds] == ["a", "g", "p:11"]
    assert [r for r, _ in ds.skipped] == [2, 3, 4, 5, 6, 9, 10, 12]
    reasons = dict(ds.skipped)
    assert reasons[2].startswith("invalid JSON")
    assert "UTF-8" in reasons[3]
    assert reasons[4] == "missing field 'problem'"
    assert reasons[5] == "field 'answer' is empty"
    assert "not a string" in reasons[6]
    assert "not an object" in reasons[9]
    assert "duplicate id 'a'" in reasons[10]
    assert "data_source" in reasons[12]
    g = ds[1]
    assert (g.prompt, g.answer, g.data_source, g.extra) == ("q7", "7", "gsm8k", {"level": 3})
    assert ds[0].data_source == "math" and ds[2].answer == "5"
    msg = caplog.text
    assert "skipped 8 bad row(s) of 11" in msg and str(f) in msg and "row 2:" in msg


def test_custom_keys_json_list_and_directory(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps([
        {"question": "Q1", "gt": "1", "src": "code"}, {"question": "Q2"}]))
    write_lines(tmp_path / "d" / "b.jsonl", [row(question="Q3", gt="3")])
    ds = load_prompt_dataset(tmp_path / "d", prompt_key="question", answer_key="gt", source_key="src",
                             default_source="arith")
    assert [(it.uid, it.prompt, it.data_source) for it in ds] == [("a:1", "Q1", "code"), ("b:1", "Q3", "arith")]
    assert ds.skipped == [(2, "a.json: missing field 'gt'")]


def test_missing_unsupported_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_prompt_dataset(tmp_path / "x.csv")
    bad = write_lines(tmp_path / "bad.jsonl", [b"{", row(problem="p")])
    with pytest.raises(ValueError, match=r"bad.jsonl: no valid rows \(2 skipped"):
        load_prompt_dataset(bad)
    (tmp_path / "l.json").write_text('{"problem": "p"}')
    with pytest.raises(ValueError, match="must hold a list"):
        load_prompt_dataset(tmp_path / "l.json")


def test_shipped_dapo_sample_loads_cleanly():
    ds = load_prompt_dataset(Path(__file__).resolve().parents[2] / "data" / "dapo_math_17k_sample.jsonl")
    assert len(ds) == 2000 and ds.skipped == []
    assert [it.answer for it in ds.items[:3]] == ["34", "113", "-3"]
    assert ds[0].uid == "dapo17k-00000"


def test_templates_text():
    p = "What is 2+3?"
    assert apply_template("dapo", p) == (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        "What is 2+3?\n\nRemember to put your answer on its own line after \"Answer:\".")
    assert apply_template("raw", p) == p
    assert apply_template("arith", "347+85") == "Q: 347+85=?\n"
    assert apply_template("boxed", p).startswith(p) and "\\boxed{}" in apply_template("boxed", p)
    with pytest.raises(KeyError, match="unknown prompt template 'nope'"):
        apply_template("nope", p)
    assert set(TEMPLATES) >= {"dapo", "boxed", "raw", "arith"}


def test_render_prompt_plain_and_chat():
    tok = build_byte_tokenizer()
    item = PromptItem("u", "1+2", "3", "arith")
    # byte tokenizer: id == byte value for ASCII
    assert render_prompt(item, "arith", tok, apply_chat_template=False) == list(b"Q: 1+2=?\n")
    chat = render_prompt(item, "raw", tok, apply_chat_template=True)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert chat == [im_start, *b"user\n1+2", im_end, *b"\n", im_start, *b"assistant\n"]
    tok.chat_template = None
    assert render_prompt(item, "raw", tok, apply_chat_template=True) == list(b"1+2")


def test_tokenize_dataset_length_filter(tmp_path, caplog):
    f = write_lines(tmp_path / "t.jsonl", [row(id="short", problem="1+2", answer="3"),
                                           row(id="long", problem="123+456", answer="579"),
                                           row(id="exact", problem="12+34", answer="46")])
    tok = build_byte_tokenizer()
    with caplog.at_level(logging.WARNING):
        ds = tokenize_dataset(load_prompt_dataset(f), tok, template="arith", max_prompt_len=11)
    # "Q: 1+2=?\n" = 9 tokens, "Q: 12+34=?\n" = 11 (kept, limit is inclusive), "Q: 123+456=?\n" = 13
    assert [it.uid for it in ds] == ["short", "exact"]
    assert ds.too_long == [("long", 13)]
    assert ds[0].prompt_ids == list(b"Q: 1+2=?\n")
    assert "long (13 tokens)" in caplog.text
    with pytest.raises(ValueError, match="every prompt is longer"):
        tokenize_dataset(load_prompt_dataset(f), tok, template="arith", max_prompt_len=5)
