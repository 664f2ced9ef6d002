"""Prompt datasets: loading with counted bad-row skips, prompt tokenisation with a length filter.

File formats: JSONL (one object per line), ``.json`` (a list of objects), ``.parquet`` (needs
pyarrow), or a directory of such files (sorted by name); a Hugging Face ``datasets.save_to_disk``
folder or ``hf:NAME?split=SPLIT`` from the HF cache (megarl.data.formats, which also describes
dotted field keys and chat-list prompts: verl's and slime's layouts). Rows are numbered from 1
(the line number for JSONL, the element / row index + 1 otherwise). Blank JSONL lines are ignored
and not counted.

A row is skipped (and recorded in ``PromptDataset.skipped`` as ``(row_number, reason)``) when
it is not valid UTF-8, not valid JSON, not an object, its prompt is missing / not a string or
chat list / blank, its answer is missing / blank / not a string or int, its data source is present but not
a non-empty string, or its id repeats an earlier id. For a directory, reasons start with the
file name. A missing or unreadable file, or a file with no valid row, raises an error naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from megarl.data import formats
from megarl.data.templates import has_chat_template, render_prompt

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class PromptItem:
    uid: str
    prompt: str
    answer: str
    data_source: str
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # set by tokenize_dataset
    reference: str | None = None  # reference / anchor response (GenRM, Pairwise-RL)
    row: int = 0  # row number in its file (messages)
    images: list | None = None  # vision-language models: the row's checked ImageRefs (megarl.data.images)
    messages: list[dict] | None = None  # a chat-list prompt's messages (its last user message is `prompt`)


@dataclass
class PromptDataset:
    items: list[PromptItem]
    path: str
    skipped: list[tuple[int, str]] = field(default_factory=list)
    too_long: list[tuple[str, int]] = field(default_factory=list)  # (uid, prompt tokens), tokenize_dataset

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"cannot read prompt dataset {path}: {e.strerror or e}") from e


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any | None, str | None]]:
    for lineno, raw in enumerate(_read_bytes(path).split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield lineno, None, f"invalid UTF-8 at byte {e.start}"
            continue
        try:
            yield lineno, json.loads(text), None
        except json.JSONDecodeError as e:
            yield lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _json_rows(path: Path) -> Iterator[tuple[int, Any | None, str | None]]:
    try:
        data = json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"prompt dataset {path}: not a valid UTF-8 JSON file: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"prompt dataset {path}: a .json file must hold a list of objects, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        yield i, row, None


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any | None, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"prompt dataset {path}: reading .parquet needs pyarrow (pip install pyarrow)") from e
    try:
        rows = pq.read_table(path).to_pylist()
    except OSError as e:
        raise OSError(f"cannot read prompt dataset {path}: {e}") from e
    for i, row in enumerate(rows, start=1):
        yield i, row, None


def _check_row(row: Any, keys: dict[str, str], default_source: str) -> tuple[dict | None, str | None]:
    """Validated fields of one row, or (None, reason)."""
    if not isinstance(row, dict):
        return None, f"row is a JSON {type(row).__name__}, not an object"
    pk, ak, sk = keys["prompt"], keys["answer"], keys["source"]
    prompt, messages = formats.field_value(row, pk), None
    if prompt is formats.MISSING or prompt is None:
        return None, f"missing field {pk!r}"
    if isinstance(prompt, (list, tuple)):
        prompt, messages, why = formats.chat_prompt(prompt, pk)
        if why is not None:
            return None, why
    if not isinstance(prompt, str):
        return None, f"field {pk!r} is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return None, f"field {pk!r} is empty"
    answer = formats.field_value(row, ak)
    if answer is formats.MISSING or answer is None:
        return None, f"missing field {ak!r}"
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        return None, f"field {ak!r} is a {type(answer).__name__}, not a string"
    if not answer.strip():
        return None, f"field {ak!r} is empty"
    source = formats.field_value(row, sk)
    source = default_source if source is formats.MISSING else source
    if not isinstance(source, str) or not source.strip():
        return None, f"field {sk!r} must be a non-empty string, got {source!r}"
    reference = formats.field_value(row, keys["reference"])
    reference = None if reference is formats.MISSING else reference
    if reference is not None and not isinstance(reference, str):
        return None, f"field {keys['reference']!r} must be a string, got {type(reference).__name__}"
    return {"prompt": prompt, "answer": answer.strip(), "source": source, "reference": reference,
            "messages": messages}, None


def _load_file(path: Path, keys: dict[str, str], default_source: str, seen: set[str],
               label: str, rows: Iterator | None = None, stem: str | None = None
               ) -> tuple[list[PromptItem], list[tuple[int, str]]]:
    """The items and skipped rows of one file (or of `rows`, an HF dataset's, named `stem`)."""
    if rows is None:
        rows = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}[path.suffix](path)
    stem = stem or path.stem
    items: list[PromptItem] = []
    skipped: list[tuple[int, str]] = []
    for rownum, row, error in rows:
        fields = None
        if error is None:
            fields, error = _check_row(row, keys, default_source)
        if error is None:
            raw_id = row.get(keys["id"])
            uid = str(raw_id) if raw_id not in (None, "") else f"{stem}:{rownum}"
            if uid in seen:
                error = f"duplicate id {uid!r}"
        if error is not None:
            skipped.append((rownum, label + error))
            continue
        seen.add(uid)
        extra = {k: v for k, v in row.items() if k not in keys.values()}
        items.append(PromptItem(uid, fields["prompt"], fields["answer"], fields["source"], extra,
                                reference=fields["reference"], row=rownum, messages=fields["messages"]))
    return items, skipped


def load_prompt_dataset(path: str | Path, *, prompt_key: str = "problem", answer_key: str = "answer",
                        source_key: str = "data_source", default_source: str = "math",
                        id_key: str = "id", reference_key: str = "reference") -> PromptDataset:
    """Load prompts from a file or directory (see the module doc for formats and skip rules).

    uid: the row's `id_key` value as a string, else ``"<file stem>:<row number>"``.
    reference: the row's `reference_key` string (a reference / anchor response), else None.
    `extra`: every other field of the row.
    """
    keys = {"prompt": prompt_key, "answer": answer_key, "source": source_key, "id": id_key,
            "reference": reference_key}
    if formats.is_hf_source(path):  # a save_to_disk folder or hf:NAME from the HF cache
        items, skipped = _load_file(Path(str(path)), keys, default_source, set(), "",
                                    formats.hf_rows(path), formats.hf_label(path))
        return _finish(str(path), items, skipped)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"prompt dataset not found: {p}")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"prompt dataset directory {p} holds no {'/'.join(SUFFIXES)} files")
    elif p.suffix in SUFFIXES:
        files = [p]
    else:
        raise ValueError(f"prompt dataset {p}: unsupported file type {p.suffix!r} (expected {', '.join(SUFFIXES)})")
    items, skipped, seen = [], [], set()
    for f in files:
        got, bad = _load_file(f, keys, default_source, seen, f"{f.name}: " if p.is_dir() else "")
        items += got
        skipped += bad
    return _finish(p, items, skipped)


def _finish(p, items: list[PromptItem], skipped: list[tuple[int, str]]) -> PromptDataset:
    """The dataset, after a warning naming the first skipped rows; an error when none is valid."""
    if skipped:
        first = "; ".join(f"row {r}: {why}" for r, why in skipped[:5])
        logger.warning("prompt dataset %s: skipped %d bad row(s) of %d (%s%s)", p, len(skipped),
                       len(skipped) + len(items), first, "; ..." if len(skipped) > 5 else "")
    if not items:
        raise ValueError(f"prompt dataset {p}: no valid rows ({len(skipped)} skipped"
                         + (f"; first: row {skipped[0][0]}: {skipped[0][1]}" if skipped else "") + ")")
    return PromptDataset(items, str(p), skipped)


def tokenize_dataset(dataset: PromptDataset, tokenizer: Any, *, template: str, max_prompt_len: int,
                     apply_chat_template: bool = False, images: Any = None, image_key: str = "images",
                     tools: list[dict] | None = None) -> PromptDataset:
    """A copy of `dataset` whose items carry `prompt_ids`; prompts longer than `max_prompt_len`
    tokens are dropped and listed in `too_long` as ``(uid, n_tokens)`` with a warning.

    images: a `megarl.data.images.ImageInputs` (vision-language models): rows with `image_key`
    get their images checked and their placeholders expanded (image tokens count towards
    max_prompt_len); a row with an unusable image is skipped into `skipped` with its reason.
    tools: tool declarations for the chat template (render_prompt), counted in max_prompt_len."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    kept, too_long, skipped = [], [], []
    base_dir = Path(dataset.path) if Path(dataset.path).is_dir() else Path(dataset.path).parent
    chat = apply_chat_template and has_chat_template(tokenizer)
    for item in dataset.items:
        if item.messages is not None and len(item.messages) > 1 and not chat:
            skipped.append((item.row, f"id {item.uid!r}: a chat-list prompt of {len(item.messages)} messages needs "
                                      "data.apply_chat_template=true and a tokenizer with a chat template"))
            continue
        visuals = images.row_visuals(item.extra, image_key) if images is not None else None  # images, videos
        if visuals is not None:
            try:
                item, ids = _with_images(item, visuals, images, base_dir, template, tokenizer, apply_chat_template)
            except ValueError as e:  # ImageError
                skipped.append((item.row, f"id {item.uid!r}: {e}"))
                continue
        else:
            ids = render_prompt(item, template, tokenizer, apply_chat_template, tools)
        if len(ids) > max_prompt_len:
            too_long.append((item.uid, len(ids)))
        else:
            kept.append(replace(item, prompt_ids=ids))
    if too_long:
        first = ", ".join(f"{uid} ({n} tokens)" for uid, n in too_long[:5])
        logger.warning("prompt dataset %s: skipped %d prompt(s) longer than max_prompt_len=%d: %s%s",
                       dataset.path, len(too_long), max_prompt_len, first, ", ..." if len(too_long) > 5 else "")
    if skipped:
        logger.warning("prompt dataset %s: skipped %d row(s) with unusable images or chat prompts: %s%s", dataset.path,
                       len(skipped),
                       "; ".join(f"row {r}: {why}" for r, why in skipped[:5]), "; ..." if len(skipped) > 5 else "")
    if not kept:
        if not skipped:
            raise ValueError(f"prompt dataset {dataset.path}: every prompt is longer than max_prompt_len={max_prompt_len}")
        raise ValueError(f"prompt dataset {dataset.path}: no usable prompt ({len(too_long)} longer than "
                         f"max_prompt_len={max_prompt_len}, {len(skipped)} with unusable images)")
    return PromptDataset(kept, dataset.path, list(dataset.skipped) + skipped, too_long)


def _with_images(item: PromptItem, raw: Any, images: Any, base_dir: Path, template: str, tokenizer: Any,
                 apply_chat_template: bool) -> tuple[PromptItem, list[int]]:
    """(item with its checked image refs and marked prompt, prompt ids with the image pads expanded)."""
    refs = images.refs(raw, base_dir)
    counts = images.check(refs)
    item = replace(item, prompt=images.with_markers(item.prompt, refs), images=refs)
    return item, images.expand(render_prompt(item, template, tokenizer, apply_chat_template), counts)
