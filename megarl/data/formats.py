"""The row shapes and sources other frameworks' datasets come in, read by megarl.data.dataset.

Field mapping: every ``data.*_key`` may be a dotted path into nested mappings, so one reader
takes the common layouts by configuration alone (configs/data/*.yaml):

- verl's preprocessed parquet (GSM8K, MATH, DAPO-Math-17k recipes): ``prompt`` a chat list,
  ``reward_model.ground_truth``, ``data_source``, ``extra_info``, ``images``.
- slime's JSONL: ``prompt`` (text or a chat list), ``label``, ``metadata``.
- Hugging Face ``datasets``: a ``save_to_disk`` folder (``state.json`` + arrow files), or a
  dataset in the local HF cache by name, ``hf:NAME?split=SPLIT&name=CONFIG`` (split defaults to
  ``train``). Loading by name goes through ``datasets.load_dataset``, so it honours
  ``HF_DATASETS_OFFLINE=1`` (the cache only) and the usual HF cache variables.

A chat-list prompt is a list of ``{"role", "content"}`` messages with text content ending in a
user message. Its last user message is the prompt text (the prompt template applies to it); the
messages before it reach the tokenizer's chat template (data.apply_chat_template). A prompt with
several messages cannot be rendered without a chat template: tokenize_dataset skips such a row
with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, urlparse

HF_PREFIX = "hf:"
MISSING = object()


def field_value(row: dict, key: str) -> Any:
    """row[key] when that key exists, else the dotted path through nested mappings, else MISSING."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def chat_prompt(value: Any, key: str) -> tuple[str | None, list[dict] | None, str | None]:
    """(last user text, messages, None) of a chat-list prompt, or (None, None, reason)."""
    if not value:
        return None, None, f"field {key!r} is an empty chat list"
    messages = []
    for i, m in enumerate(value):
        if isinstance(m, str):  # some JSON exports keep each message as a JSON string
            try:
                m = json.loads(m)
            except json.JSONDecodeError:
                pass
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, None, (f"field {key!r} is a list, not a string or a chat list of {{role, content}} "
                                f"messages (message {i}: {str(m)[:40]!r})")
        if not isinstance(m.get("content"), str):
            return None, None, (f"field {key!r}: message {i} has {type(m.get('content')).__name__} content; "
                                "only text content is read (images go in data.image_key)")
        messages.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] != "user":
        return None, None, f"field {key!r}: the last message is {messages[-1]['role']!r}, not 'user'"
    text = messages[-1]["content"]
    if not text.strip():
        return None, None, f"field {key!r}: the last user message is empty"
    return text, messages, None


def is_hf_dataset_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists())


def is_hf_source(path: str | Path) -> bool:
    return str(path).startswith(HF_PREFIX) or is_hf_dataset_dir(Path(path))


def parse_hf_name(spec: str) -> tuple[str, str | None, str]:
    """("NAME", config or None, split) of ``hf:NAME?split=S&name=C``."""
    u = urlparse(spec[len(HF_PREFIX):])
    query = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(query) - {"split", "name"}
    if not u.path or unknown:
        raise ValueError(f"prompt dataset {spec!r}: expected hf:NAME[?split=SPLIT][&name=CONFIG]"
                         + (f" (unknown {sorted(unknown)})" if unknown else ""))
    return u.path, query.get("name"), query.get("split", "train")


def load_hf(path: str | Path):
    """The datasets.Dataset of a save_to_disk folder or of ``hf:NAME?...`` (the HF cache)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"prompt dataset {path}: reading HF datasets needs the datasets package "
                          "(pip install 'datasets==5.2.0' or megarl[data])") from e
    if str(path).startswith(HF_PREFIX):
        name, config, split = parse_hf_name(str(path))
        try:
            return datasets.load_dataset(name, config, split=split)
        except Exception as e:  # ConnectionError offline, FileNotFoundError, ValueError for a bad split
            raise ValueError(f"prompt dataset {path}: cannot load HF dataset {name!r} (config {config}, split "
                             f"{split!r}): {type(e).__name__}: {e}") from e
    p = Path(path)
    if (p / "dataset_dict.json").exists():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"prompt dataset {p}: a DatasetDict with splits {splits}; point the path at one split's "
                         f"folder, e.g. {p / (splits[0] if splits else 'train')}")
    try:
        return datasets.load_from_disk(str(p))
    except Exception as e:
        raise ValueError(f"prompt dataset {p}: not a readable datasets.save_to_disk folder: {e}") from e


def hf_rows(path: str | Path) -> Iterator[tuple[int, Any | None, str | None]]:
    """(row number from 1, row, None) of an HF dataset, images as stored ({bytes, path}), not decoded."""
    ds = load_hf(path)
    n = 0
    for batch in ds.with_format("arrow").iter(batch_size=1000):
        for row in batch.to_pylist():
            n += 1
            yield n, row, None


def hf_label(path: str | Path) -> str:
    """The uid prefix of an HF source's rows (a file stem plays that part for files)."""
    if str(path).startswith(HF_PREFIX):
        name, _, split = parse_hf_name(str(path))
        return f"{name.rsplit('/', 1)[-1]}-{split}"
    return Path(path).name
