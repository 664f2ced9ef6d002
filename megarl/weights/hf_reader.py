"""Reading an HF checkpoint directory: safetensors (single file or sharded with an index),
config.json, generation_config.json and whether a tokenizer is there. megarl's one HF reader: the
Megatron import, the builtin engine and the SGLang engine all read through it.

`HFCheckpoint.read(name, dim, start, stop)` reads only rows/columns [start, stop) of one tensor
through `safe_open(...).get_slice`, so a rank never loads tensors (or parts) it does not own;
`iter_checkpoint_buckets` yields whole tensors, one bucket per shard file. Every failure names the
tensor and the file.

Fused expert tensors (qwen3_vl_moe) come in two layouts on disk (`expert_layout`); a checkpoint in
transformers 5's own layout ([E, 2I, H] / [E, H, I]) is presented in the released one ([E, H, 2I] /
[E, I, H]) by `shape` and `read`, so the bridge, the import and the builtin engine see one layout.
Families whose bridge reads experts one by one (every family but qwen3_vl_moe; e.g. the released
Qwen3.5-MoE checkpoints store fused experts) see a fused checkpoint per expert instead:
`...mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` ([I, H], [I, H], [H, I]), each
read from its slice of the fused tensor on disk (`expert_layout.per_expert_views`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or does not match the model."""


class HFCheckpoint:
    """Lazy, sliced access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.dir} does not exist")
        self._handles: dict[Path, object] = {}
        self.files = self._index()  # tensor name -> file path
        self._transposed: set[str] = set()  # fused expert tensors stored in transformers 5's layout
        self._views: dict[str, tuple[str, int, int, int]] = {}  # per-expert name -> (fused name, e, part, parts)
        self.expert_layout = self._expert_layout()  # None, "released" or "transformers5"
        if self.expert_layout is not None:
            self._split_fused_experts()

    def _index(self) -> dict[str, Path]:
        index = self.dir / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            files = {name: self.dir / fname for name, fname in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.exists():
                    raise CheckpointError(f"{path} is listed in {index} but does not exist")
            return files
        single = self.dir / SINGLE_NAME
        if not single.exists():
            found = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if len(found) != 1:
                raise CheckpointError(
                    f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME} found "
                    f"(safetensors files present: {found or 'none'}; .bin checkpoints are not read)")
            single = self.dir / found[0]
        return {name: single for name in self._handle(single).keys()}

    def _expert_layout(self) -> str | None:
        from megarl.weights.expert_layout import (
            TRANSFORMERS5, ExpertLayoutError, fused_expert_layout, is_fused_expert)

        fused = [n for n in self.files if is_fused_expert(n)]
        if not fused:
            return None
        config = self.dir / "config.json"
        try:
            layout = fused_expert_layout({n: self.shape(n) for n in fused},
                                         read_json(config) if config.is_file() else None)
        except (ExpertLayoutError, ValueError) as e:
            raise CheckpointError(f"{self.dir}: {e}") from e
        if layout == TRANSFORMERS5:
            self._transposed = set(fused)
        return layout

    def _split_fused_experts(self) -> None:
        from megarl.weights.expert_layout import FUSED_EXPERT_FAMILIES, is_fused_expert, per_expert_views

        config = self.dir / "config.json"
        if (read_json(config) if config.is_file() else {}).get("model_type") in FUSED_EXPERT_FAMILIES:
            return
        for name in [n for n in self.files if is_fused_expert(n)]:
            views = per_expert_views(name, self.shape(name)[0])
            path = self.files.pop(name)
            self.files.update({v: path for v in views})
            self._views.update(views)

    def _read_view(self, name: str) -> torch.Tensor:
        """Expert e's part (gate, up or down; HF Linear [out, in]) of a fused tensor, read from its slice."""
        fused, e, part, parts = self._views[name]
        sl = self._handle(self.files[name]).get_slice(fused)
        stored = sl.get_shape()
        if fused in self._transposed:  # [E, parts x out, in] on disk
            rows = stored[1] // parts
            return sl[e:e + 1, part * rows:(part + 1) * rows, :][0]
        cols = stored[2] // parts  # released: [E, in, parts x out]
        return sl[e:e + 1, :, part * cols:(part + 1) * cols][0].t()

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # SafetensorError, OSError: header/IO problems
                raise CheckpointError(f"cannot open safetensors file {path}: {e}") from e
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self.files)

    def file_of(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the HF checkpoint {self.dir}")
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        path = self.file_of(name)
        if name in self._views:
            fused, _, _, parts = self._views[name]
            _, a, b = self._fused_shape(fused, path)
            return (b // parts, a)  # released [E, in, parts x out] -> [out, in]
        try:
            shape = tuple(self._handle(path).get_slice(name).get_shape())
            return (shape[0], shape[2], shape[1]) if name in self._transposed else shape
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {path}: cannot read its header ({e})") from e

    def _fused_shape(self, fused: str, path: Path) -> tuple[int, ...]:
        shape = tuple(self._handle(path).get_slice(fused).get_shape())
        return (shape[0], shape[2], shape[1]) if fused in self._transposed else shape

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The full tensor (dim=None) or the range [start, stop) along dim 0 or 1."""
        path = self.file_of(name)
        try:
            if name in self._views:
                t = self._read_view(name)
                return (t if dim is None else t[start:stop] if dim == 0 else t[:, start:stop]).contiguous()
            handle = self._handle(path)
            if name in self._transposed:  # stored [E, b, a]: read, then present as [E, a, b]
                sl = handle.get_slice(name)
                part = sl[:] if dim is None else sl[start:stop] if dim == 0 else sl[:, :, start:stop]
                return part.transpose(1, 2).contiguous()
            if dim is None:
                return handle.get_tensor(name)
            sl = handle.get_slice(name)
            return sl[start:stop] if dim == 0 else sl[:, start:stop]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {path}: read failed ({e})") from e

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        actual = self.shape(name)
        if tuple(actual) != tuple(expected):
            raise CheckpointError(
                f"shape mismatch for tensor {name!r} in {self.file_of(name)}: checkpoint has "
                f"{tuple(actual)}, the model built from config.json expects {tuple(expected)}")


def iter_checkpoint_buckets(hf_dir: str | Path) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One bucket of (hf_name, tensor) per safetensors shard, in index order (CPU tensors)."""
    ckpt = HFCheckpoint(hf_dir)
    by_file: dict[Path, list[str]] = {}
    for name, path in ckpt.files.items():
        by_file.setdefault(path, []).append(name)
    for names in by_file.values():
        yield [(name, ckpt.read(name)) for name in names]


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


def has_tokenizer(hf_dir: str | Path) -> bool:
    return any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES)
