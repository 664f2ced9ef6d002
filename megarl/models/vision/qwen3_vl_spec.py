"""Qwen3-VL (HF model_type `qwen3_vl`, e.g. Qwen3-VL-8B) and Qwen3-VL-MoE (`qwen3_vl_moe`, e.g.
Qwen3-VL-30B-A3B, -235B-A22B) in megarl's family registry.

The language model is Qwen3 (q/k RMSNorm per head, GQA, no biases) with *interleaved* M-RoPE
(`qwen3_vl_model.InterleavedMRoPE`); in Qwen3-VL-MoE every MLP is a top-k softmax MoE whose top-k
probabilities are always renormalised (HF's `Qwen3VLMoeTextTopKRouter` divides by their sum
whatever the config says). `ArchSpec.vision` is a `Qwen3VisionSpec`. HF checkpoints name the
tensors `model.visual.*` (tower, merger, DeepStack mergers), `model.language_model.*` and
`lm_head.weight`; Qwen3-VL-MoE stores each layer's experts as two fused tensors
(`ArchSpec.hf_fused_experts`, layouts in `qwen3_vl_bridge`, both on-disk layouts read by
`megarl.weights.expert_layout`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megarl.models.families import ArchSpec, UnsupportedModelError, _moe, register_family
from megarl.models.families import qwen3 as _qwen3_dense
from megarl.models.vision.spec import PatchGeometry

# HF ACT2FN names of the vision MLP activations megarl reproduces exactly (torch functional forms)
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")


@dataclass(frozen=True)
class Qwen3VisionSpec(PatchGeometry):
    """Qwen3-VL vision tower: patch embedding (Conv3d, kernel = stride = (tp, p, p), with bias) plus
    a learned `num_position_embeddings` (= side^2) position table resampled bilinearly to each image's
    grid; `depth` pre-norm blocks (LayerNorm eps 1e-6, fused-qkv attention with biases and 2D RoPE
    over each whole frame, non-gated MLP fc1 -> `hidden_act` -> fc2 with biases); the merger
    (LayerNorm(c), m x m patches concatenated, Linear(4c, 4c) + GELU + Linear(4c, out_hidden_size));
    and one DeepStack merger per entry of `deepstack_visual_indexes` (the same, but LayerNorm(4c)
    after the concatenation) on that block's output, added to the LM hidden states at the image
    tokens after LM layer k for the k-th DeepStack feature."""

    depth: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    head_dim: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    out_hidden_size: int
    rope_theta: float
    norm_eps: float
    image_token_id: int
    video_token_id: int | None

    video_frame_runs = True  # one run per temporal patch of a video, each after its timestamp text

    @property
    def position_grid_side(self) -> int:
        """Side of the learned position grid: int(sqrt(num_position_embeddings)), as HF."""
        return int(self.num_position_embeddings**0.5)


def _fail(what: str, model_type: str = "qwen3_vl_moe"):
    raise UnsupportedModelError(f"model_type={model_type!r}: {what} is not supported")


def qwen3_vision_spec(hf_config: Any) -> Qwen3VisionSpec:
    v, mt = hf_config.vision_config, hf_config.model_type
    if v.hidden_act not in VISION_ACTIVATIONS:
        _fail(f"vision hidden_act={v.hidden_act!r} (supported: {list(VISION_ACTIVATIONS)})", mt)
    rope = getattr(v, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        _fail(f"vision rope_type={rope.get('rope_type')!r}", mt)
    if v.hidden_size % v.num_heads:
        _fail(f"vision hidden_size={v.hidden_size} not divisible by num_heads={v.num_heads}", mt)
    indexes = tuple(int(i) for i in getattr(v, "deepstack_visual_indexes", None) or ())  # Qwen3.5: none
    if any(not 0 <= i < v.depth for i in indexes):
        _fail(f"deepstack_visual_indexes={list(indexes)} outside the {v.depth} vision blocks", mt)
    return Qwen3VisionSpec(
        depth=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.intermediate_size, num_heads=v.num_heads,
        head_dim=v.hidden_size // v.num_heads, hidden_act=v.hidden_act, in_channels=v.in_channels,
        patch_size=int(v.patch_size), temporal_patch_size=int(v.temporal_patch_size),
        spatial_merge_size=v.spatial_merge_size, num_position_embeddings=v.num_position_embeddings,
        deepstack_visual_indexes=indexes, out_hidden_size=v.out_hidden_size,
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=1e-6,
        image_token_id=int(hf_config.image_token_id), video_token_id=int(hf_config.video_token_id))


def _qwen3_vl(hf_config: Any, lm: ArchSpec, **moe) -> ArchSpec:
    """The LM spec `lm` of `text_config` with interleaved M-RoPE, the vision tower and its DeepStack
    mergers, HF's `model.language_model.` names."""
    model_type = hf_config.model_type
    section = tuple(int(x) for x in (getattr(hf_config.text_config, "rope_parameters", None) or {})
                    .get("mrope_section") or ())
    if len(section) != 3 or sum(section) != lm.head_dim // 2:
        _fail(f"mrope_section={list(section)} (need 3 sections summing to head_dim/2 = {lm.head_dim // 2})",
              model_type)
    vision = qwen3_vision_spec(hf_config)
    if vision.out_hidden_size != lm.hidden_size:
        _fail(f"vision out_hidden_size={vision.out_hidden_size} != text hidden_size={lm.hidden_size}", model_type)
    if len(vision.deepstack_visual_indexes) > lm.num_layers:
        _fail(f"{len(vision.deepstack_visual_indexes)} DeepStack features for {lm.num_layers} LM layers", model_type)
    return dataclasses.replace(
        lm, model_type=model_type, mrope_section=section, vision=vision, hf_prefix="model.language_model.",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), **moe)


@register_family("qwen3_vl_moe", vision_language=True)
def qwen3_vl_moe(hf_config: Any) -> ArchSpec:
    """Qwen3-VL-MoE: the Qwen3-MoE LM of `text_config` (fused expert tensors), interleaved M-RoPE,
    the vision tower and its DeepStack mergers."""
    text = hf_config.text_config
    return _qwen3_vl(hf_config, _moe(text, _qwen3_dense(text), shared_expert_ffn=0), norm_topk_prob=True,
                     hf_fused_experts=True)


@register_family("qwen3_vl", vision_language=True)
def qwen3_vl(hf_config: Any) -> ArchSpec:
    """Qwen3-VL (dense): the Qwen3 LM of `text_config`, interleaved M-RoPE, the vision tower and its
    DeepStack mergers."""
    return _qwen3_vl(hf_config, _qwen3_dense(hf_config.text_config))
