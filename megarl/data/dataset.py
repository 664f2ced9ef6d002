"""Prompt datasets: loading with counted bad-row skips, prompt tokenisation with a length filter.

File formats: JSONL (one object per line), ``.json`` (a list of objects), ``.parquet`` (needs
pyarrow), or a directory of such files (sorted by name). Rows are numbered from 1 (the line
number for JSONL, the element / row index + 1 otherwise). Blank JSONL lines are ignored and not
counted.

A row is skipped (and recorded in ``PromptDataset.skipped`` as ``(row_number, reason)``) when
it is not valid UTF-8, not valid JSON, not an object, its prompt is missing / not a string /
blank, its answer is missing / blank / not a string or int, its data source is present but not
a non-empty string, or its id repeats an earlier id. For a directory, reasons start with the
file name. A missing or unreadable file, or a file with no valid row, raises an error naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from megarl.data.templates import render_prompt

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
    prompt = row.get(pk)
    if prompt is None:
        return None, f"missing field {pk!r}"
    if not isinstance(prompt, str):
        return None, f"field {pk!r} is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return None, f"field {pk!r} is empty"
    answer = row.get(ak)
    if answer is None:
        return None, f"missing field {ak!r}"
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        return None, f"field {ak!r} is a {type(answer).__name__}, not a string"
    if not answer.strip():
        return None, f"field {ak!r} is empty"
    source = row.get(sk, default_source)
    if not isinstance(source, str) or not source.strip():
        return None, f"field {sk!r} must be a non-empty string, got {source!r}"
    reference = row.get(keys["reference"])
    if reference is not None and not isinstance(reference, str):
        return None, f"field {keys['reference']!r} must be a string, got {type(reference).__name__}"
    return {"prompt": prompt, "answer": answer.strip(), "source": source, "reference": reference}, None


def _load_file(path: Path, keys: dict[str, str], default_source: str, seen: set[str],
               label: str) -> tuple[list[PromptItem], list[tuple[int, str]]]:
    reader = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}[path.suffix]
    items: list[PromptItem] = []
    skipped: list[tuple[int, str]] = []
    for rownum, row, error in reader(path):
        fields = None
        if error is None:
            fields, error = _check_row(row, keys, default_source)
        if error is None:
            raw_id = row.get(keys["id"])
            uid = str(raw_id) if raw_id not in (None, "") else f"{path.stem}:{rownum}"
            if uid in seen:
                error = f"duplicate id {uid!r}"
        if error is not None:
            skipped.append((rownum, label + error))
            continue
        seen.add(uid)
        extra = {k: v for k, v in row.items() if k not in keys.values()}
        items.append(PromptItem(uid, fields["prompt"], fields["answer"], fields["source"], extra,
                                reference=fields["reference"], row=rownum))
    return items, skipped


def load_prompt_dataset(path: str | Path, *, prompt_key: str = "problem", answer_key: str = "answer",
                        source_key: str = "data_source", default_source: str = "math",
                        id_key: str = "id", reference_key: str = "reference") -> PromptDataset:
    """Load prompts from a file or directory (see the module doc for formats and skip rules).

    uid: the row's `id_key` value as a string, else ``"<file stem>:<row number>"``.
    reference: the row's `reference_key` string (a reference / anchor response), else None.
    `extra`: every other field of the row.
    """
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
    keys = {"prompt": prompt_key, "answer": answer_key, "source": source_key, "id": id_key,
            "reference": reference_key}
    items, skipped, seen = [], [], set()
    for f in files:
        got, bad = _load_file(f, keys, default_source, seen, f"{f.name}: " if p.is_dir() else "")
        items += got
        skipped += bad
    if skipped:
        first = "; ".join(f"row {r}: {why}" for r, why in skipped[:5])
        logger.warning("prompt dataset %s: skipped %d bad row(s) of %d (%s%s)", p, len(skipped),
                       len(skipped) + len(items), first, "; ..." if len(skipped) > 5 else "")
    if not items:
        raise ValueError(f"prompt dataset {p}: no valid rows ({len(skipped)} skipped"
                         + (f"; first: row {skipped[0][0]}: {skipped[0][1]}" if skipped else "") + ")")
    return PromptDataset(items, str(p), skipped)


def tokenize_dataset(dataset: PromptDataset, tokenizer: Any, *, template: str, max_prompt_len: int,
                     apply_chat_template: bool = False, images: Any = None, image_key: str = "images") -> PromptDataset:
    """A copy of `dataset` whose items carry `prompt_ids`; prompts longer than `max_prompt_len`
    tokens are dropped and listed in `too_long` as ``(uid, n_tokens)`` with a warning.

    images: a `megarl.data.images.ImageInputs` (vision-language models): rows with `image_key`
    get their images checked and their placeholders expanded (image tokens count towards
    max_prompt_len); a row with an unusable image is skipped into `skipped` with its reason."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    kept, too_long, skipped = [], [], []
    base_dir = Path(dataset.path) if Path(dataset.path).is_dir() else Path(dataset.path).parent
    for item in dataset.items:
        if images is not None and item.extra.get(image_key) is not None:
            try:
                item, ids = _with_images(item, item.extra[image_key], images, base_dir, template, tokenizer,
                                         apply_chat_template)
            except ValueError as e:  # ImageError
                skipped.append((item.row, f"id {item.uid!r}: {e}"))
                continue
        else:
            ids = render_prompt(item, template, tokenizer, apply_chat_template)
        if len(ids) > max_prompt_len:
            too_long.append((item.uid, len(ids)))
        else:
            kept.append(replace(item, prompt_ids=ids))
    if too_long:
        first = ", ".join(f"{uid} ({n} tokens)" for uid, n in too_long[:5])
        logger.warning("prompt dataset %s: skipped %d prompt(s) longer than max_prompt_len=%d: %s%s",
                       dataset.path, len(too_long), max_prompt_len, first, ", ..." if len(too_long) > 5 else "")
    if skipped:
        logger.warning("prompt dataset %s: skipped %d row(s) with unusable images: %s%s", dataset.path, len(skipped),
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
    from megarl.data.images import image_refs

    refs = image_refs(raw, base_dir)
    counts = images.check(refs)
    item = replace(item, prompt=images.with_markers(item.prompt, len(refs)), images=refs)
    return item, images.expand(render_prompt(item, template, tokenizer, apply_chat_template), counts)
