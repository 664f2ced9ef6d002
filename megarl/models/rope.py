"""RoPE inverse frequencies as HF transformers computes them (default, linear, llama3).

megatron-core 0.16.1's `RotaryEmbedding(rope_scaling=True)` implements the llama3 rule but with
`low_freq_factor=1`, `high_freq_factor=4` and `original_max_position_embeddings=8192` hard-coded
(only `factor` is an argument). Configs may use other values, so `build_model` computes the
frequencies here from the config and installs them on the rotary module.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def rope_type_of(hf_config: Any) -> str:
    scaling = getattr(hf_config, "rope_scaling", None)
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """inv_freq[i] = 1 / base^(2i / dim), i = 0 .. dim/2 - 1 (float32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 frequency rescaling. With wavelen = 2π / f, L = original_max_position_embeddings:

        wavelen > L / low_freq_factor   ->  f / factor                    (low frequencies)
        wavelen < L / high_freq_factor  ->  f                             (high frequencies)
        otherwise                       ->  (1 - s) f / factor + s f,
                                            s = (L / wavelen - low_freq_factor)
                                                / (high_freq_factor - low_freq_factor)
    """
    old_len = original_max_position_embeddings
    low_wavelen = old_len / low_freq_factor
    high_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def hf_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """The float32 inverse frequencies HF uses for this config (rope types in SUPPORTED_ROPE_TYPES)."""
    inv_freq = default_inv_freq(float(getattr(hf_config, "rope_theta", 10000.0)), head_dim)
    rope = rope_type_of(hf_config)
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if rope == "default":
        return inv_freq
    if rope == "linear":
        return inv_freq / float(scaling["factor"])
    if rope == "llama3":
        return llama3_inv_freq(
            inv_freq, float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    raise ValueError(f"rope type {rope!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})")
