"""Tiny random Qwen2.5-VL models, images and prompts for the vision-language tests.

Text vocabulary 160 (not a multiple of 128: TP vocab padding is exercised), image placeholder
token 150, vision start / end 152 / 153; vision tower: 2 blocks (block 1 full attention, block 0
windowed with 2x2 merged tokens a window), hidden 32, 2 heads, patch 4, merge 2; LM: 2 layers,
hidden 64, GQA 4/2 heads, M-RoPE sections [2, 3, 3]. Images go through HF's own image processor
(`Qwen2VLImageProcessorPil`, built locally), so pixel_values / image_grid_thw are what HF's
processor produces. Weights are drawn with larger scales than HF's init, so logits are O(1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

IMAGE, VSTART, VEND, VIDEO = 150, 152, 153, 151
TEXT_VOCAB = 150  # text tokens are drawn from [0, 150)


def tiny_vlm_config(tie: bool = False):
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def image_processor():
    return transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 64)


def make_tiny_vlm(path: str | Path, seed: int = 0, tie: bool = False) -> Path:
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(tie)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    return Path(path)


def random_batch(seed: int, sizes=((20, 37), (48, 40), (9, 9), (33, 18)), rows: int = 2, extra_text: int = 5):
    """(input_ids [rows, s], pixel_values, image_grid_thw, mm_token_type_ids): random RGB images of
    the given (height, width) pixels through the image processor, dealt to the rows in order (row 0
    the first ones: HF's row-major image order), each image as <vision_start> <IMAGE x n>
    <vision_end> between random text; rows topped up with text to one length (no attention mask)."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    proc = image_processor()(images=images, return_tensors="pt")
    grid = proc["image_grid_thw"]
    counts = (grid.prod(-1) // 4).tolist()
    text = lambda n: rng.integers(0, TEXT_VOCAB, n).tolist()  # noqa: E731
    seqs = [[] for _ in range(rows)]
    for k, n in enumerate(counts):
        seqs[k * rows // len(counts)] += text(int(rng.integers(1, 4))) + [VSTART] + [IMAGE] * n + [VEND]
    length = max(len(s) for s in seqs) + extra_text
    ids = torch.tensor([s + text(length - len(s)) for s in seqs])
    return ids, proc["pixel_values"], grid, (ids == IMAGE).int()


@torch.no_grad()
def hf_vlm_logits(path, ids, pixel_values, grid, mm_types) -> torch.Tensor:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                 mm_token_type_ids=mm_types).logits.float()


def make_prompt(sizes, seed: int):
    """(token ids, HF image-processor output or None): text, then each image framed by vision
    start / end tokens and followed by text."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150, 3).tolist()
    if not sizes:
        return ids + rng.integers(0, 150, 5).tolist(), None
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    proc = image_processor()(images=images, return_tensors="pt")
    for n in (proc["image_grid_thw"].prod(-1) // 4).tolist():
        ids += [VSTART] + [IMAGE] * n + [VEND] + rng.integers(0, 150, 2).tolist()
    return ids, {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
