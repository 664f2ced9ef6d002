"""RoPE settings and inverse frequencies as HF transformers computes them (default, linear, llama3).

`rope_params` reads the RoPE settings of any HF config version: transformers >= 5 keeps them in
one `rope_parameters` dict (`rope_theta`, `rope_type`, `factor`, ...); 4.x configs and their
config.json files have a top-level `rope_theta` and an optional `rope_scaling` dict.

megatron-core 0.16.1's `RotaryEmbedding(rope_scaling=True)` implements the llama3 rule but with
`low_freq_factor=1`, `high_freq_factor=4` and `original_max_position_embeddings=8192` hard-coded
(only `factor` is an argument). Configs may use other values, so `build_model` computes the
frequencies here from the config and installs them on the rotary module.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# `RotaryEmbeddingConfigMixin.default_theta` in transformers 5.x, and the `rope_theta` default of
# the 4.x Qwen2Config / Qwen3Config / LlamaConfig constructors.
DEFAULT_ROPE_THETA = 10000.0
_ORIGINAL_LENGTH_TYPES = frozenset({"llama3", "yarn", "longrope"})
_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                "max_position_embeddings", "original_max_position_embeddings")


class RopeParams(NamedTuple):
    """theta: the RoPE base; scaling: the rope-type dict (with `rope_type`), None for plain RoPE."""

    theta: float
    scaling: dict | None


def _config_fields(hf_config: Any) -> dict:
    if isinstance(hf_config, dict):
        return hf_config
    return {key: getattr(hf_config, key) for key in _CONFIG_KEYS if hasattr(hf_config, key)}


def _default_theta(hf_config: Any) -> float:
    return float(getattr(type(hf_config), "default_theta", DEFAULT_ROPE_THETA))


def hf_rope_parameters(hf_config: Any) -> dict:
    """The flat RoPE dict transformers 5.19 derives from a config (object or config.json dict).

    Mirrors `RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` + `standardize_rope_params`:
    start from `rope_scaling or rope_parameters`; `rope_theta` = the dict's value, else the
    top-level `rope_theta`, else the config class's `default_theta` (1e4 for qwen2/qwen3/llama);
    `rope_type` = `rope_type`, else the legacy `type`, else "default"; `partial_rotary_factor`
    from the top level when the dict lacks it; for llama3/yarn/longrope,
    `original_max_position_embeddings` = the top-level field when present (it wins), else the
    dict's value, else `max_position_embeddings`. Per-layer-type (nested) dicts raise ValueError.
    """
    fields = _config_fields(hf_config)
    params = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope_parameters {params} are not supported")
    if params.get("rope_theta") is None:
        top = fields.get("rope_theta")
        params["rope_theta"] = _default_theta(hf_config) if top is None else top
    params["rope_theta"] = float(params["rope_theta"])
    legacy_type = params.pop("type", "default")
    params.setdefault("rope_type", legacy_type)
    if "partial_rotary_factor" not in params and fields.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = fields["partial_rotary_factor"]
    if params["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        if fields.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = fields.get("max_position_embeddings")
    return params


def rope_params(hf_config: Any) -> RopeParams:
    """(theta, scaling) of an HF config of any transformers version, or of a config.json dict.

    scaling is `hf_rope_parameters` without `rope_theta`, or None when the rope type is "default".
    """
    params = hf_rope_parameters(hf_config)
    theta = params.pop("rope_theta")
    return RopeParams(theta, None if params["rope_type"] == "default" else params)


def rope_type_of(hf_config: Any) -> str:
    return hf_rope_parameters(hf_config)["rope_type"]


def partial_rotary_factor(hf_config: Any) -> float:
    """Fraction of each head that is rotated (`partial_rotary_factor`, 1.0 when absent)."""
    return float(hf_rope_parameters(hf_config).get("partial_rotary_factor") or 1.0)


def scaling_type(scaling: dict | None) -> str:
    """The rope type a scaling dict names (`rope_type`, legacy `type`), "default" for None."""
    scaling = scaling or {}
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


def scaled_inv_freq(theta: float, scaling: dict | None, dim: int) -> torch.Tensor:
    """float32 inverse frequencies for `rope_params` output: default_inv_freq(theta, dim), then

    scaling None / "default": unchanged;  "linear": / factor;  "llama3": `llama3_inv_freq`.
    Other rope types raise ValueError.
    """
    inv_freq = default_inv_freq(theta, dim)
    rope = scaling_type(scaling)
    if rope == "default":
        return inv_freq
    if rope == "linear":
        return inv_freq / float(scaling["factor"])
    if rope == "llama3":
        return llama3_inv_freq(
            inv_freq, float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    raise ValueError(f"rope type {rope!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})")


def hf_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """The float32 inverse frequencies HF uses for this config (rope types in SUPPORTED_ROPE_TYPES)."""
    theta, scaling = rope_params(hf_config)
    return scaled_inv_freq(theta, scaling, head_dim)
