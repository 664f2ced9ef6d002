"""YaRN RoPE (DeepSeek-V3, Kimi-K2) as transformers 5.19 computes it, and how megatron matches it.

HF (`modeling_rope_utils._compute_yarn_parameters`, `deepseek_v3.yarn_apply_mscale`), for the
rotated dimension d, base theta, factor s and the pre-training length L0:

    extrapolation f_e[i] = 1 / theta^(2i/d),   interpolation f_i[i] = f_e[i] / s
    low, high = floor / ceil of d * ln(L0 / (beta * 2 pi)) / (2 ln theta) for beta_fast, beta_slow,
               clamped to [0, d - 1]
    ramp[i] = clamp((i - low) / (high - low), 0, 1)        (high += 0.001 when equal)
    inv_freq = f_i * ramp + f_e * (1 - ramp)
    cos / sin scale ("attention factor") = m(s, mscale) / m(s, mscale_all_dim) when both are set
                                            (non-zero), else m(s, 1);  m(s, k) = 0.1 k ln s + 1 (1 if s <= 1)
    softmax scale = 1 / sqrt(q_head_dim) * m(s, mscale_all_dim)^2 when mscale_all_dim is set.

megatron-core 0.16.1's `YarnRotaryEmbedding` (used by multi-latent attention) computes the same
frequencies with `correction_range_round_to_int=True` and the factor
m(s, mscale) / m(s, mscale_all_dim), so megarl passes mscale = 1 whenever HF would ignore it
(mscale_all_dim unset): both then give m(s, 1). Settings megatron cannot express (an explicit
`attention_factor`, `truncate: false`) are refused by `yarn_settings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnSettings:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float  # as megatron takes it (1 where HF ignores the config's value)
    mscale_all_dim: float  # 0 = unset


def mscale_of(scale: float, k: float = 1.0) -> float:
    """m(s, k) = 0.1 k ln s + 1 for s > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def yarn_settings(params: dict, max_position_embeddings: int) -> YarnSettings:
    """The YaRN settings of a flat HF rope dict (`megarl.models.rope.hf_rope_parameters`);
    ValueError for what megatron's YaRN cannot reproduce."""
    if params.get("attention_factor") is not None:
        raise ValueError("yarn rope with an explicit attention_factor is not supported")
    if params.get("truncate") is False:
        raise ValueError("yarn rope with truncate=false is not supported")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    all_dim = float(params.get("mscale_all_dim") or 0.0)
    mscale = float(params.get("mscale") or 1.0) if all_dim else 1.0
    return YarnSettings(factor, original, float(params.get("beta_fast") or 32),
                        float(params.get("beta_slow") or 1), mscale, all_dim)


def attention_factor(s: YarnSettings) -> float:
    """The scale of cos and sin (HF `attention_scaling`)."""
    if s.mscale_all_dim:
        return mscale_of(s.factor, s.mscale) / mscale_of(s.factor, s.mscale_all_dim)
    return mscale_of(s.factor)


def softmax_mscale(s: YarnSettings | None) -> float:
    """The factor on 1 / sqrt(q_head_dim) in the attention softmax (1 without YaRN)."""
    if s is None or not s.mscale_all_dim:
        return 1.0
    return mscale_of(s.factor, s.mscale_all_dim) ** 2


def yarn_inv_freq(theta: float, dim: int, s: YarnSettings) -> torch.Tensor:
    """float32 inverse frequencies of the `dim` rotated dimensions (module docstring)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    keep = 1 - ramp  # the extrapolated share, written as HF writes it (bit-equal frequencies)
    return 1.0 / (s.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
