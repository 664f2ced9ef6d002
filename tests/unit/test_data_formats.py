"""One prompt reader for the layouts people have (megarl.data.formats): verl's parquet, slime's
JSONL, datasets.save_to_disk folders and HF-cache datasets by name read into the same items as the
native rows; bad rows are skipped, counted and named in every format."""

import io
import json

import pytest

from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
from megarl.tasks.tiny_model import build_byte_tokenizer
from tests.unit import formats_fixtures as F

NATIVE = [{"id": f"n{i}", "problem": f"{i} + {i}", "answer": str(2 * i), "data_source": "arith"} for i in range(6)]
VERL_KEYS = dict(prompt_key="prompt", answer_key="reward_model.ground_truth")


def fields(ds):
    return [(it.prompt, it.answer, it.data_source) for it in ds]


def load(path, **keys):
    return load_prompt_dataset(path, **{"prompt_key": "problem", **keys})


def test_verl_parquet_reads_like_the_native_rows(tmp_path):
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NATIVE))
    F.write_verl_parquet(NATIVE, tmp_path / "v.parquet")
    native, verl = load(tmp_path / "n.jsonl"), load(tmp_path / "v.parquet", **VERL_KEYS)
    assert fields(verl) == fields(native)
    assert verl[2].extra["extra_info"] == {"split": "train", "index": 2, "question": "2 + 2"}
    assert verl[2].messages == [{"role": "user", "content": "2 + 2"}]
    tok = build_byte_tokenizer()
    ids = lambda ds: [it.prompt_ids for it in tokenize_dataset(ds, tok, template="arith", max_prompt_len=64)]  # noqa: E731
    assert ids(verl) == ids(native)


def test_verl_images_reach_the_item_as_stored_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    rows = [F.verl_row(NATIVE[0], 0, images=[{"bytes": buf.getvalue(), "path": None}])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    (item,) = load(tmp_path / "v.parquet", **VERL_KEYS)
    assert item.extra["images"] == [{"bytes": buf.getvalue(), "path": None}]


def test_bad_verl_rows_are_skipped_counted_and_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = F.verl_row(NATIVE[0], 0)
    rows = [good,
            {**good, "prompt": [{"role": "assistant", "content": "hi"}]},             # 2 last message not user
            {**good, "reward_model": {"style": "rule", "ground_truth": None}},        # 3 no answer
            {**good, "prompt": []},                                                   # 4 empty chat
            {**good, "prompt": [{"role": "user", "content": "   "}]}]                 # 5 blank user text
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    ds = load(tmp_path / "v.parquet", **VERL_KEYS)
    assert len(ds) == 1
    reasons = dict(ds.skipped)
    assert sorted(reasons) == [2, 3, 4, 5]
    assert "'assistant', not 'user'" in reasons[2]
    assert reasons[3] == "missing field 'reward_model.ground_truth'"
    assert "empty chat list" in reasons[4] and "empty" in reasons[5]


def test_a_multi_turn_chat_prompt_needs_a_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1"}],
             "label": "2"}, {"prompt": "2 + 2", "label": "4"}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load(tmp_path / "s.jsonl", prompt_key="prompt", answer_key="label")
    tok = build_byte_tokenizer()
    plain = tokenize_dataset(ds, tok, template="raw", max_prompt_len=64)
    assert [it.prompt for it in plain] == ["2 + 2"]
    assert "2 messages needs data.apply_chat_template=true" in plain.skipped[0][1] and plain.skipped[0][0] == 1
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = tokenize_dataset(ds, tok, template="raw", max_prompt_len=64, apply_chat_template=True)
    assert tok.decode(chat[0].prompt_ids) == "<system>Be brief.<user>1 + 1<assistant>"


def test_slime_jsonl_reads_like_the_native_rows(tmp_path):
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NATIVE))
    F.write_slime_jsonl(NATIVE, tmp_path / "s.jsonl")
    slime = load(tmp_path / "s.jsonl", prompt_key="prompt", answer_key="label")
    assert fields(slime) == fields(load(tmp_path / "n.jsonl"))
    assert slime[1].extra["metadata"] == {"id": "n1"}


def test_save_to_disk_folder_reads_like_the_native_rows(tmp_path):
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NATIVE))
    F.write_save_to_disk(NATIVE + [{"id": "bad", "problem": "", "answer": "1", "data_source": "arith"}], tmp_path / "d")
    ds = load(tmp_path / "d")
    assert fields(ds) == fields(load(tmp_path / "n.jsonl")) and [it.uid for it in ds] == [r["id"] for r in NATIVE]
    assert ds.skipped == [(7, "field 'problem' is empty")]


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(NATIVE), "test": datasets.Dataset.from_list(NATIVE)}
                         ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\].*dd/train"):
        load(tmp_path / "dd")
    assert len(load(tmp_path / "dd" / "train")) == len(NATIVE)


def test_hf_cache_dataset_by_name_and_split_offline(tmp_path, monkeypatch):
    import datasets

    spec = F.build_hf_cache({"train": NATIVE, "test": NATIVE[:2]}, tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_DATASETS_OFFLINE=1 sets at import
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NATIVE))
    assert fields(load(spec)) == fields(load(tmp_path / "n.jsonl"))
    assert len(load("hf:me/tiny-arith?split=test")) == 2
    with pytest.raises(ValueError, match="cannot load HF dataset 'me/absent'"):
        load("hf:me/absent")
    with pytest.raises(ValueError, match="unknown"):
        load("hf:me/tiny-arith?splt=test")
