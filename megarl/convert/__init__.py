"""Checkpoint conversion between HF safetensors and megatron-core torch_dist, and its verification
against HF transformers (`megarl convert`; `cli` holds the command, `verify_vlm` the
vision-language verification batch)."""
