"""megarl.weights: HF safetensors in (rank-local slices), HF-named bucket stream out, torch_dist."""

from megarl.weights.dist_ckpt import (
    load_checkpoint_hf_config, load_megatron_checkpoint, read_checkpoint_meta,
    save_megatron_checkpoint)
from megarl.weights.hf_reader import CheckpointError, HFCheckpoint
from megarl.weights.hf_writer import save_hf_checkpoint
from megarl.weights.load_hf import load_hf_weights
from megarl.weights.stream import consume, stream_hf_weights

__all__ = [
    "CheckpointError", "HFCheckpoint", "consume", "load_checkpoint_hf_config", "load_hf_weights",
    "load_megatron_checkpoint", "read_checkpoint_meta", "save_hf_checkpoint",
    "save_megatron_checkpoint", "stream_hf_weights",
]
