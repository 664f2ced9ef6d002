"""Qwen2.5-VL (HF model_type `qwen2_5_vl`) in megarl's family registry.

The language model is Qwen2 (q/k/v biases, GQA, SwiGLU, RMSNorm) with M-RoPE
(`ArchSpec.mrope_section`); `ArchSpec.vision` holds the vision tower's facts (`VisionSpec`).
HF checkpoints name the tensors `visual.*` (tower + merger) and `model.*` / `lm_head.weight`
(language model, as Qwen2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megarl.models.families import ArchSpec, UnsupportedModelError, _common, register_family


class PatchGeometry:
    """Sizes derived from a vision spec's fields (in_channels, temporal_patch_size, patch_size,
    hidden_size, spatial_merge_size)."""

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: C * tp * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_size(self) -> int:
        """Merger input width: hidden_size * m^2."""
        return self.hidden_size * self.spatial_merge_size**2

    # Qwen3-VL writes each temporal patch of a video as a run of its own (`mrope.video_frame_grids`)
    video_frame_runs = False


@dataclass(frozen=True)
class VisionSpec(PatchGeometry):
    """Qwen2.5-VL vision tower: patch embedding (Conv3d, kernel = stride = (tp, p, p), no bias),
    `depth` pre-norm blocks (RMSNorm eps 1e-6, fused-qkv attention with biases and 2D RoPE, SwiGLU
    MLP with biases), windowed attention except in `fullatt_block_indexes`, then the merger:
    RMSNorm, m x m patches concatenated, Linear(4c, 4c) + GELU + Linear(4c, out_hidden_size)."""

    depth: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    head_dim: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    rope_theta: float
    norm_eps: float
    image_token_id: int
    video_token_id: int | None
    tokens_per_second: int = 4  # M-RoPE temporal ids per second of video (HF vision_config.tokens_per_second)


def _fail(what: str):
    raise UnsupportedModelError(f"model_type='qwen2_5_vl': {what} is not supported")


def vision_spec(hf_config: Any) -> VisionSpec:
    v = hf_config.vision_config
    if getattr(v, "hidden_act", "silu") != "silu":
        _fail(f"vision hidden_act={v.hidden_act!r} (only 'silu')")
    rope = getattr(v, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        _fail(f"vision rope_type={rope.get('rope_type')!r}")
    if v.hidden_size % v.num_heads:
        _fail(f"vision hidden_size={v.hidden_size} not divisible by num_heads={v.num_heads}")
    return VisionSpec(
        depth=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.intermediate_size, num_heads=v.num_heads,
        head_dim=v.hidden_size // v.num_heads, in_channels=v.in_channels, patch_size=int(v.patch_size),
        temporal_patch_size=int(v.temporal_patch_size), spatial_merge_size=v.spatial_merge_size,
        window_size=v.window_size, fullatt_block_indexes=tuple(int(i) for i in v.fullatt_block_indexes),
        out_hidden_size=v.out_hidden_size, rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=1e-6,
        image_token_id=int(hf_config.image_token_id), video_token_id=int(hf_config.video_token_id),
        tokens_per_second=int(getattr(v, "tokens_per_second", 4)))


@register_family("qwen2_5_vl", vision_language=True)
def qwen2_5_vl(hf_config: Any) -> ArchSpec:
    """Qwen2.5-VL: the Qwen2 LM of `text_config` with M-RoPE, plus the vision tower."""
    text = hf_config.text_config
    head_dim = text.hidden_size // text.num_attention_heads  # HF's text attention ignores head_dim
    lm = _common(text, head_dim=head_dim, add_qkv_bias=True, qk_layernorm=False)
    section = tuple(int(x) for x in (getattr(text, "rope_parameters", None) or {}).get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2:
        _fail(f"mrope_section={list(section)} (need 3 sections summing to head_dim/2 = {head_dim // 2})")
    vision = vision_spec(hf_config)
    if vision.out_hidden_size != lm.hidden_size:
        _fail(f"vision out_hidden_size={vision.out_hidden_size} != text hidden_size={lm.hidden_size}")
    return dataclasses.replace(lm, model_type="qwen2_5_vl", mrope_section=section, vision=vision,
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
