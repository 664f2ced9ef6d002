"""Reading an HF checkpoint directory: config.json, generation_config.json, safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the checkpoint directory")
    return read_json(path)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def eos_token_ids(config: dict, hf_dir: str | Path | None = None) -> list[int]:
    """EOS ids from config.json (its `text_config` too) and, when present, generation_config.json
    (union, ordered)."""
    ids = _as_id_list(config.get("eos_token_id"))
    ids += _as_id_list((config.get("text_config") or {}).get("eos_token_id"))  # vision-language configs
    gen_path = Path(hf_dir) / "generation_config.json" if hf_dir is not None else None
    if gen_path is not None and gen_path.is_file():
        ids += _as_id_list(read_json(gen_path).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """Shard files in index order (sharded checkpoint) or the single model.safetensors."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: missing or empty 'weight_map'")
        files = [hf_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (hf_dir / SINGLE_FILE).is_file():
        files = [hf_dir / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard listed in {INDEX_FILE} is missing")
    return files


def iter_checkpoint_buckets(hf_dir: str | Path) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields one bucket of (hf_name, tensor) per safetensors shard (CPU tensors)."""
    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield [(name, f.get_tensor(name)) for name in f.keys()]


def has_tokenizer(hf_dir: str | Path) -> bool:
    return any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES)
