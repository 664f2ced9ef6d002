"""Import HF safetensors straight into this rank's Megatron shards (any TP/PP/VPP layout).

Each rank reads only the tensors of its own pipeline stage(s), and of those only its TP slice
(`HFCheckpoint.read` slices through safetensors `get_slice`). Load before building the
optimizer: mixed-precision / distributed optimizers copy the parameters into their main params.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megarl.models.bridge import (
    VALUE_HEAD_HF_NAME, expected_hf_shapes, hf_shapes, param_maps, read_shard, shard_group)
from megarl.models.builder import unwrap
from megarl.models.deepseek import mtp_names
from megarl.weights.hf_reader import CheckpointError, HFCheckpoint

_log = logging.getLogger(__name__)

# Tensors some HF checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _show(names: set[str], limit: int = 6) -> str:
    shown = sorted(names)[:limit]
    return ", ".join(shown) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def open_checkpoint(hf_dir: str | Path):
    """The HF checkpoint at hf_dir, its block-FP8 weights (DeepSeek-V3, Kimi-K2) read dequantized
    (`megarl.weights.fp8_blocks`)."""
    from megarl.weights.fp8_blocks import dequantized
    from megarl.weights.hf_reader import read_config

    config = Path(hf_dir) / "config.json"
    return dequantized(HFCheckpoint(hf_dir), read_config(hf_dir) if config.is_file() else None)


def check_checkpoint(ckpt: HFCheckpoint, spec, value_head: bool = False) -> None:
    """Raises CheckpointError (naming tensor and file) unless the checkpoint has exactly the
    tensors, with the shapes, that the model built from `spec` needs. Reads headers only."""
    expected = expected_hf_shapes(spec, value_head)
    optional = {VALUE_HEAD_HF_NAME} if value_head else set()
    have = ckpt.names()
    missing = set(expected) - have - optional
    if missing:
        raise CheckpointError(f"HF checkpoint {ckpt.dir} is missing tensors: {_show(missing)}")
    extra = {n for n in have - set(expected) if not n.endswith(_IGNORED_SUFFIXES)}
    mtp = mtp_names(extra, spec)  # DeepSeek-V3 / GLM-4.5 multi-token prediction: not loaded
    if mtp:
        _log.warning("HF checkpoint %s: skipping %d tensors of %d multi-token-prediction layer(s) (%s): megarl "
                  "trains and exports the decoder only", ckpt.dir, len(mtp), spec.mtp_layers, _show(mtp, 2))
        extra -= mtp
    if spec.tie_word_embeddings or value_head:
        extra.discard("lm_head.weight")  # tied copy (or an actor's head when building a critic)
    if extra:
        files = sorted({ckpt.files[n].name for n in extra})
        raise CheckpointError(
            f"HF checkpoint {ckpt.dir} has tensors the {spec.model_type!r} bridge does not map "
            f"(wrong config.json?): {_show(extra)} in {files}")
    for name, shape in expected.items():
        if name in have:
            ckpt.check_shape(name, shape)


@torch.no_grad()
def load_hf_weights(model_chunks, hf_dir: str | Path) -> int:
    """Copies this rank's shards from the HF checkpoint into `model_chunks`; returns bytes read."""
    from megarl.models.value_head import ValueModel

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    ckpt = open_checkpoint(hf_dir)
    models = [unwrap(c) for c in chunks]
    spec = models[0].arch_spec
    check_checkpoint(ckpt, spec, value_head=isinstance(models[0], ValueModel))
    read_bytes = 0
    for model in models:
        for pm, param in param_maps(model, spec):
            if pm.optional and pm.hf_names[0] not in ckpt.names():
                continue
            tp, tp_rank = shard_group(pm)  # expert-TP for experts
            for name, shape in zip(pm.hf_names, hf_shapes(pm, tuple(param.shape), spec, tp)):
                ckpt.check_shape(name, shape)
            shard = read_shard(pm, ckpt, spec, tuple(param.shape), tp_rank, tp)
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{pm.hf_names} in {ckpt.file_of(pm.hf_names[0])}: shard shape {tuple(shard.shape)} "
                    f"!= megatron parameter {pm.megatron_name} shape {tuple(param.shape)}")
            param.data.copy_(shard)
            read_bytes += shard.numel() * shard.element_size()
    return read_bytes
