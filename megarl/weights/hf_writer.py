"""Write an HF checkpoint (safetensors shards + index, config, tokenizer) from a weight stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file

from megarl.weights.dist_ckpt import copy_hf_files
from megarl.weights.hf_reader import INDEX_NAME, SINGLE_NAME


def save_hf_checkpoint(stream: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str | Path,
                       hf_config: Any = None, hf_source_dir: str | Path | None = None,
                       max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Consumes the stream on this rank and writes `out_dir`; returns the safetensors files.

    Shards hold at most `max_shard_bytes` (one bigger tensor gets its own shard); more than one
    shard gets `model-0000i-of-0000n.safetensors` names and a `model.safetensors.index.json`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, parts, total, seen = 0, [], 0, set()

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            path = out / f".part-{len(parts):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            parts.append((path, sorted(shard)))
        shard, shard_bytes = {}, 0

    for bucket in stream:
        for name, tensor in bucket:
            if name in seen:
                raise ValueError(f"weight stream yielded tensor {name!r} twice")
            seen.add(name)
            n = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + n > max_shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
            shard_bytes += n
            total += n
    flush()
    files = []
    if len(parts) == 1:
        parts[0][0].rename(out / SINGLE_NAME)
        files.append(out / SINGLE_NAME)
    else:
        weight_map = {}
        for i, (path, names) in enumerate(parts):
            final = out / f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    copy_hf_files(hf_source_dir, out, hf_config)
    if not any(n.endswith("_scale_inv") for n in seen):
        _drop_quantization_config(out / "config.json")
    return files


def _drop_quantization_config(path: Path) -> None:
    """A block-FP8 model's config (DeepSeek-V3, Kimi-K2) exported with the stream's plain weights must
    not claim FP8 weights (transformers and SGLang would read the tensors as such)."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
