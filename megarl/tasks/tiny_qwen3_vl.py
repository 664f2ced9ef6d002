"""A tiny random Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`), Qwen3-VL
(`Qwen3VLForConditionalGeneration`) or Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, `hybrid`)
with the byte-level tokenizer and small-image / video processor settings, built offline for the
VLM-MoE quickstarts and the tests.

Tokenizer and chat template: `megarl.tasks.tiny_vlm.build_vlm_tokenizer` (bytes, EOS / chat tokens,
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``), vocabulary rounded
up to `vocab_multiple`.

Model: the text quickstart's LM shape in Qwen3 form (3 layers, hidden 128, 4 heads / 2 kv heads of
head_dim 32 with q/k RMSNorm, no biases) with interleaved M-RoPE sections (6, 5, 5); MoE (default):
every MLP `num_experts` experts of FFN `moe_intermediate`, top-`moe_topk` (renormalised); dense:
SwiGLU 384. Vision tower: 2 blocks (hidden 64, 2 heads, tanh-GELU MLP 128), patch 4, temporal patch
2, 2x2 merge (one image token covers 8x8 pixels: a 48x48 image is 36 tokens), an 8 x 8 learned
position table, DeepStack after blocks 0 and 1 (added after LM layers 0 and 1). HF's own
initialisation (`initializer_range` 0.02), fp32.

Processor files: `preprocessor_config.json` (`Qwen2VLImageProcessorPil`, patch 4, merge 2, pixels
within [16x16, 64x64]; `AutoImageProcessor` loads it) and `video_preprocessor_config.json` in
`Qwen3VLVideoProcessor`'s format (the same patch sizes, whole clips within [2 x 16x16, 8 x 64x64]
pixels, mean / std 0.5, fps 2, at most 16 frames), which `megarl.data.video` reads (transformers
5.19 itself cannot build a video processor without torchvision).

Qwen3.5-MoE (`hybrid=True`, megarl.models.hybrid): the same sizes, but every LM layer but the last a
gated delta-net (2 key / 4 value heads of 32, convolution kernel 4), the last gated attention with
RoPE on a quarter of each head (interleaved M-RoPE sections (2, 1, 1)), a gated shared expert of
`moe_intermediate` beside the routed experts, and no DeepStack.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.tasks.tiny_model import EOS_TOKEN
from megarl.tasks.tiny_vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, VISION_TOKENS, build_vlm_tokenizer


@dataclass
class TinyQwen3VLSpec:
    """Sizes of the tiny Qwen3-VL(-MoE) (module doc)."""

    moe: bool = True
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 384
    num_experts: int = 4
    moe_topk: int = 2
    moe_intermediate: int = 192
    mrope_section: tuple[int, int, int] = (6, 5, 5)  # sums to head_dim / 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    vocab_multiple: int = 64
    initializer_range: float = 0.02
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    vision_intermediate: int = 128
    patch_size: int = 4
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_position_embeddings: int = 64
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    min_pixels: int = 16 * 16
    max_pixels: int = 64 * 64
    max_frames: int = 16
    hybrid: bool = False  # Qwen3.5-MoE (module doc); needs moe


HYBRID_MROPE_SECTION = (2, 1, 1)  # sums to head_dim / 8: RoPE covers a quarter of each head


def tiny_qwen3_vl_config(tokenizer: Any, spec: TinyQwen3VLSpec) -> Any:
    """The `Qwen3VLMoeConfig` / `Qwen3VLConfig` / `Qwen3_5MoeConfig` (hybrid) of `spec`, with the vision
    token ids of `tokenizer`."""
    import transformers

    mrope = HYBRID_MROPE_SECTION if spec.hybrid else spec.mrope_section
    rotary_dim = spec.head_dim // 4 if spec.hybrid else spec.head_dim
    if sum(mrope) != rotary_dim // 2 or spec.heads % spec.kv_heads or (spec.hybrid and not spec.moe):
        raise ValueError(f"tiny Qwen3-VL: mrope_section {mrope} must sum to {rotary_dim // 2}, heads {spec.heads} "
                         f"divide by kv_heads {spec.kv_heads}, and hybrid needs moe")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    text = dict(
        vocab_size=math.ceil(len(tokenizer) / spec.vocab_multiple) * spec.vocab_multiple, hidden_size=spec.hidden,
        intermediate_size=spec.intermediate, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6, initializer_range=spec.initializer_range, bos_token_id=eos, eos_token_id=eos,
        pad_token_id=eos, rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section),
                                           "rope_theta": spec.rope_theta, "mrope_interleaved": True})
    if spec.moe:
        text.update(num_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk,
                    moe_intermediate_size=spec.moe_intermediate)
    if spec.hybrid:
        text["rope_parameters"].update(mrope_section=list(mrope), partial_rotary_factor=0.25)
        text.update(layer_types=["linear_attention"] * (spec.layers - 1) + ["full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=spec.head_dim,
                    linear_value_head_dim=spec.head_dim, shared_expert_intermediate_size=spec.moe_intermediate)
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
        num_heads=spec.vision_heads, in_channels=3, patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size, spatial_merge_size=spec.merge_size,
        out_hidden_size=spec.hidden, num_position_embeddings=spec.num_position_embeddings,
        hidden_act="gelu_pytorch_tanh", initializer_range=spec.initializer_range)
    if spec.hybrid:
        cls = transformers.Qwen3_5MoeConfig
    else:
        vision["deepstack_visual_indexes"] = list(spec.deepstack_visual_indexes)
        cls = transformers.Qwen3VLMoeConfig if spec.moe else transformers.Qwen3VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
               vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
               tie_word_embeddings=spec.tie_word_embeddings, dtype="float32")


def build_tiny_qwen3_vl(tokenizer: Any, spec: TinyQwen3VLSpec, seed: int = 0) -> Any:
    """A randomly initialised model (fp32) of `spec`."""
    import transformers

    config = tiny_qwen3_vl_config(tokenizer, spec)
    cls = (transformers.Qwen3_5MoeForConditionalGeneration if spec.hybrid else
           transformers.Qwen3VLMoeForConditionalGeneration if spec.moe else transformers.Qwen3VLForConditionalGeneration)
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=torch.float32)


def video_processor_config(spec: TinyQwen3VLSpec) -> dict:
    """`video_preprocessor_config.json` of the tiny model (Qwen3VLVideoProcessor's fields)."""
    return {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": spec.patch_size,
            "temporal_patch_size": spec.temporal_patch_size, "merge_size": spec.merge_size,
            "size": {"shortest_edge": 2 * spec.min_pixels, "longest_edge": 8 * spec.max_pixels},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_sample_frames": False, "fps": 2,
            "min_frames": 1, "max_frames": spec.max_frames, "cap_pixels_per_frame": False}


def save_tiny_qwen3_vl(out_dir: str | Path, spec: TinyQwen3VLSpec | None = None, seed: int = 0,
                       model: Any = None) -> Path:
    """Build (unless given) and save the model (safetensors, transformers' own `save_pretrained`),
    generation config, tokenizer, image processor and video processor settings into `out_dir`."""
    from transformers import GenerationConfig, Qwen2VLImageProcessorPil

    spec = spec or TinyQwen3VLSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    model = model if model is not None else build_tiny_qwen3_vl(tokenizer, spec, seed)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=eos, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                             merge_size=spec.merge_size, min_pixels=spec.min_pixels,
                             max_pixels=spec.max_pixels).save_pretrained(out)
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(spec), indent=2) + "\n")
    return out
