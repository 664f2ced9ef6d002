"""megatron-core `torch_dist` checkpoints of the model, reloadable under any TP/PP layout.

Layout of a checkpoint directory:

    <dir>/model/             dist_checkpointing.save(model.sharded_state_dict())
    <dir>/hf/                config.json (+ generation_config.json) and tokenizer files
    <dir>/megarl_model.json  format version, model_type, padded vocabulary size, saved TP/PP

Unpickling: a torch_dist checkpoint has two pickled files. `common.pt` is read by megatron with
a bare `torch.load`, which in torch >= 2.6 defaults to `weights_only=True` (we refuse to load
when TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD overrides that default, and pre-read the file with
`weights_only=True`). torch DCP reads `.metadata` with plain `pickle.load`; before any load we
unpickle it with an allow-list of the torch DCP metadata classes, so a tampered file fails
before torch ever unpickles it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.models.builder import unwrap
from megarl.weights.hf_reader import CheckpointError

FORMAT = "megarl-torch_dist-v1"
META_NAME = "megarl_model.json"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
            "added_tokens.json", "chat_template.jinja",
            # vision-language models: the image processor (megarl.data.images) and processor settings
            "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def copy_hf_files(src: str | Path | None, dst: str | Path, hf_config: Any = None) -> None:
    """Copies config + tokenizer files from an HF dir (or saves `hf_config`) into dst."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if hf_config is not None:
        hf_config.save_pretrained(dst)
    if src is not None:
        for name in HF_FILES:
            if (Path(src) / name).exists() and not (hf_config is not None and name == "config.json"):
                shutil.copy2(Path(src) / name, dst / name)


def model_sharded_state_dict(model_chunks) -> dict:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def save_megatron_checkpoint(model_chunks, ckpt_dir: str | Path, hf_config: Any,
                             hf_source_dir: str | Path | None = None, async_requests: list | None = None) -> None:
    """Collective: saves the model as torch_dist plus HF config/tokenizer files and metadata.

    With `async_requests` (a list), the shards are not written here: megatron's async save
    request is appended for the caller to schedule (megarl.trainer.checkpoint); its metadata
    files appear only when the request is finalised."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megarl.weights.threaded_writer import use_threaded_writers

    use_threaded_writers()  # also for the optimizer save that follows (megarl.trainer.train_model.save)
    ckpt_dir = Path(ckpt_dir)
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    model = unwrap(chunks[0])
    if dist.get_rank() == 0:
        (ckpt_dir / "model").mkdir(parents=True, exist_ok=True)
        copy_hf_files(hf_source_dir, ckpt_dir / "hf", hf_config)
        meta = dict(format=FORMAT, model_type=model.arch_spec.model_type,
                    padded_vocab_size=model.vocab_size, hf_vocab_size=model.hf_vocab_size,
                    saved_tp=ps.get_tensor_model_parallel_world_size(),
                    saved_pp=ps.get_pipeline_model_parallel_world_size(),
                    saved_ep=ps.get_expert_model_parallel_world_size(),
                    value_head=model.__class__.__name__ == "ValueModel")
        (ckpt_dir / META_NAME).write_text(json.dumps(meta, indent=2))
    dist.barrier()
    request = dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir / "model"),
                                      async_sharded_save=async_requests is not None)
    if async_requests is not None:
        async_requests.append(request)
    dist.barrier()


def read_checkpoint_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / META_NAME
    if not path.exists():
        raise CheckpointError(f"{path} not found: {ckpt_dir} is not a megarl model checkpoint")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_checkpoint_hf_config(ckpt_dir: str | Path):
    from transformers import AutoConfig

    hf = Path(ckpt_dir) / "hf"
    if not (hf / "config.json").exists():
        raise CheckpointError(f"{hf / 'config.json'} not found")
    from megarl.models.deepseek import register_kimi_config

    register_kimi_config()  # Kimi-K2's model_type "kimi_k2" reads as DeepSeek-V3
    return AutoConfig.from_pretrained(hf)


def padded_vocab_for(meta: dict, tp: int) -> int | None:
    """Reuse the saved padded vocab size when this TP size divides it (else pad afresh)."""
    padded = int(meta["padded_vocab_size"])
    return padded if padded % tp == 0 else None


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Allows only torch DCP metadata classes (dataclasses / enums), torch.Size, dtypes, layouts."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name)
        if (module, name) in self._ALLOWED or isinstance(obj, torch.dtype):
            return obj
        if module.startswith("torch.distributed.checkpoint.") and isinstance(obj, type):
            return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def check_checkpoint_files(model_dir: str | Path) -> None:
    """Validates the pickled files of a torch_dist checkpoint without executing foreign code."""
    model_dir = Path(model_dir)
    for name in ("metadata.json", ".metadata", "common.pt"):
        if not (model_dir / name).exists():
            raise CheckpointError(f"torch_dist checkpoint file {model_dir / name} is missing")
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") not in ("", "0"):
        raise CheckpointError("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: refusing to load "
                              f"{model_dir / 'common.pt'} with full unpickling")
    try:
        with open(model_dir / ".metadata", "rb") as f:
            _DcpMetadataUnpickler(f).load()
    except Exception as e:
        raise CheckpointError(f"{model_dir / '.metadata'}: not valid torch DCP metadata ({e})") from e
    try:
        torch.load(model_dir / "common.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{model_dir / 'common.pt'}: unreadable with weights_only=True ({e})") from e


def dcp_metadata(model_dir: str | Path):
    """The torch DCP metadata (`.metadata`) of a torch_dist directory, unpickled with the allow-list."""
    with open(Path(model_dir) / ".metadata", "rb") as f:
        return _DcpMetadataUnpickler(f).load()


def torch_dist_problems(model_dir: str | Path) -> list[str]:
    """Why the torch_dist directory `model_dir` cannot be loaded (empty when complete): a missing
    file, foreign pickles (`check_checkpoint_files`), or a shard file missing or shorter than
    the byte ranges the DCP metadata assigns to it. Reads no tensor data."""
    model_dir = Path(model_dir)
    try:
        check_checkpoint_files(model_dir)
        metadata = dcp_metadata(model_dir)
    except CheckpointError as e:
        return [str(e)]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = model_dir / name
        have = path.stat().st_size if path.exists() else None
        if have is None or have < size:
            problems.append(f"{path}: {'missing' if have is None else f'{have} bytes'}, the metadata needs {size}")
    return problems


ARCH_FIELDS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "head_dim", "vocab_size", "add_qkv_bias", "qk_layernorm",
               "num_experts", "moe_topk", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size")


def check_same_architecture(ckpt_dir: str | Path, spec) -> None:
    """Raises CheckpointError naming the first architecture field (ArchSpec, read from the
    checkpoint's hf/config.json) in which the checkpoint differs from the model `spec` describes."""
    from megarl.models.families import arch_spec

    read_checkpoint_meta(ckpt_dir)
    saved = arch_spec(load_checkpoint_hf_config(ckpt_dir))
    for name in ARCH_FIELDS:
        if getattr(saved, name) != getattr(spec, name):
            raise CheckpointError(
                f"checkpoint {ckpt_dir} holds another model: {name} is {getattr(saved, name)!r} in its "
                f"hf/config.json but {getattr(spec, name)!r} in the model being loaded (built from model.hf_path)")


def load_megatron_checkpoint(model_chunks, ckpt_dir: str | Path) -> None:
    """Collective: loads this rank's shards of a torch_dist model checkpoint (any saved layout)."""
    from megatron.core import dist_checkpointing

    model_dir = Path(ckpt_dir) / "model"
    problems = torch_dist_problems(model_dir)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete or corrupt: " + "; ".join(problems))
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    check_same_architecture(ckpt_dir, unwrap(chunks[0]).arch_spec)
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), str(model_dir))
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state)
    else:
        for i, c in enumerate(chunks):
            unwrap(c).load_state_dict(state[f"model{i}"])
