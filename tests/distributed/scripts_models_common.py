"""Tiny random HF models of every supported dense family, for the model/weights tests.

Vocabularies (150, 130) are not multiples of 128, so Megatron's TP vocab padding is exercised.
Weights are drawn with larger scales than HF's init (std 0.02 would make every logit ~0 and the
equivalence checks toothless).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def tiny_config(family: str):
    if family == "qwen2":
        return transformers.Qwen2Config(vocab_size=150, tie_word_embeddings=False, rope_theta=1000.0,
                                        **COMMON)
    if family == "qwen3":  # head_dim 24 != hidden / heads = 16
        return transformers.Qwen3Config(vocab_size=150, head_dim=24, tie_word_embeddings=False, **COMMON)
    if family == "llama3":  # llama3 RoPE with non-default low/high factors and original length
        return transformers.LlamaConfig(
            vocab_size=150, tie_word_embeddings=False, rope_theta=100.0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 2.0, "original_max_position_embeddings": 16}, **COMMON)
    if family == "llama_tied":
        return transformers.LlamaConfig(vocab_size=130, tie_word_embeddings=True, **COMMON)
    raise ValueError(family)


FAMILIES = ("qwen2", "qwen3", "llama3", "llama_tied")


def make_tiny_hf(family: str, path: str | Path, seed: int = 0, hidden: int | None = None,
                 layers: int | None = None) -> Path:
    """Creates and saves a random HF model; returns its directory."""
    cfg = tiny_config(family)
    if hidden:
        cfg.hidden_size, cfg.intermediate_size = hidden, hidden * 2
        cfg.head_dim = hidden // cfg.num_attention_heads
    if layers:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = ["full_attention"] * layers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    return Path(path)


@torch.no_grad()
def hf_logits(path: str | Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model(ids).logits.float()
