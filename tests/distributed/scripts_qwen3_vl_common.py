"""Tiny random Qwen3-VL / Qwen3-VL-MoE checkpoints and prompts with images and videos, for the tests
of the builtin engine, the trainer and the conversion on these families.

Models (`tiny_qwen3_vl_config`): LM 3 layers, hidden 64, GQA 4/2 heads of head_dim 32 (q/k norms),
interleaved M-RoPE sections [6, 5, 5], vocabulary 160 (TP padding exercised); MoE: 6 experts top-2
of FFN 24 (or 32: hidden = 2 x FFN, where gate_up_proj's shape is the same in both on-disk
layouts); dense: MLP 96. Vision: 3 blocks (hidden 32, 2 heads, tanh-GELU MLP 48), patch 4, merge 2,
a 6 x 6 learned position table, DeepStack after blocks 0 and 1 (added after LM layers 0 and 1).
Saved by transformers' own `save_pretrained`, so a MoE file holds transformers 5's fused expert
layout ([E, 2I, H] / [E, H, I]); `released=True` rewrites it as the released checkpoints store it.
Weights are drawn with larger scales than HF's init, so logits are O(1).

Prompts (`make_prompt`): random text with images (HF's image processor, PIL backend) and / or one
video (random pixels of grid (t, h, w)); a Qwen3-VL video is one run of video pads per temporal
patch, each after a timestamp (random text here) and between vision start / end, as HF's
processor writes it; a Qwen2.5-VL video is one run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

IMAGE, VIDEO, VSTART, VEND = 150, 151, 152, 153
TEXT_VOCAB = 150


def tiny_qwen3_vl_config(moe: bool = True, expert_ffn: int = 24, layers: int = 3, deepstack=(0, 1), tie: bool = False):
    text = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5],
                                                    "rope_theta": 1000.0, "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=36,
                  deepstack_visual_indexes=list(deepstack))
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
               tie_word_embeddings=tie)
    if moe:
        text.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=expert_ffn)
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


def hf_class(config):
    return (transformers.Qwen3VLMoeForConditionalGeneration if config.model_type == "qwen3_vl_moe"
            else transformers.Qwen3VLForConditionalGeneration)


def make_tiny_qwen3_vl(path: str | Path, seed: int = 0, released: bool = False, **config_kw) -> Path:
    """A random tiny model saved by HF at `path` (module doc)."""
    config = tiny_qwen3_vl_config(**config_kw)
    torch.manual_seed(seed)
    model = hf_class(config)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    if released:
        f = Path(path) / "model.safetensors"
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})
    return Path(path)


def hf_model(path: str | Path):
    config = transformers.AutoConfig.from_pretrained(path)
    return hf_class(config).from_pretrained(path, dtype=torch.float32).eval()


def image_processor():
    return transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 64)


def make_prompt(sizes=(), video=None, seed: int = 0, frame_runs: bool = True):
    """(token ids, processor-style dict or None): text, each image (h, w) framed by vision start /
    end and followed by text, then the video of grid `video` = (t, h, w) patches (random pixels),
    then text. frame_runs: Qwen3-VL's layout of a video (one run per temporal patch, each after a
    timestamp); False: Qwen2.5-VL's (one run)."""
    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(0, TEXT_VOCAB, n).tolist()  # noqa: E731
    ids, out = text(3), {}
    if sizes:
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        proc = image_processor()(images=images, return_tensors="pt")
        out.update(pixel_values=proc["pixel_values"], image_grid_thw=proc["image_grid_thw"])
        for n in (proc["image_grid_thw"].prod(-1) // 4).tolist():
            ids += [VSTART] + [IMAGE] * n + [VEND] + text(2)
    if video is not None:
        t, h, w = video
        gen = torch.Generator().manual_seed(seed)
        out.update(pixel_values_videos=torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=gen),
                   video_grid_thw=torch.tensor([[t, h, w]]), second_per_grid_ts=torch.tensor([1.0]))
        per = h * w // 4
        runs = [per] * t if frame_runs else [t * per]
        for n in runs:
            ids += (text(2) if frame_runs else []) + [VSTART] + [VIDEO] * n + [VEND]
        ids += text(2)
    else:
        ids += text(4)
    return ids, (out or None)


def mm_types(ids: torch.Tensor) -> torch.Tensor:
    """HF's mm_token_type_ids: 1 at image pads, 2 at video pads."""
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
