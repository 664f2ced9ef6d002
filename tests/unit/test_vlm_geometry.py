"""Qwen2.5-VL vision-tower index arithmetic (megarl.models.vision.geometry) and the family spec vs
the installed transformers: patch positions, windows, attention segments, 2D RoPE angles, patch /
merge shapes against HF's image processor and HF's own modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import vision_utils
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionPatchEmbed, Qwen2_5_VLPatchMerger, Qwen2_5_VLVisionRotaryEmbedding)

from megarl.models.families import UnsupportedModelError, arch_spec
from megarl.models.vision import geometry
from tests.distributed.scripts_vlm_common import image_processor, tiny_vlm_config

GRIDS = [
    [[1, 4, 10], [1, 12, 10], [1, 4, 4], [1, 8, 4]],
    [[2, 6, 14], [1, 2, 2]],  # a 2-frame entry: segments per frame
    [[1, 16, 16]],  # exact multiple of the window: HF pads a row of empty windows
]


@pytest.mark.parametrize("grid", GRIDS)
def test_positions_windows_and_segments_equal_hf(grid):
    g = torch.tensor(grid)
    assert torch.equal(geometry.patch_hw_positions(g, 2), vision_utils.get_vision_position_ids(g, 2))
    assert geometry.patch_cu_seqlens(g) == vision_utils.get_vision_cu_seqlens(g).tolist()
    for window_size, patch in ((16, 4), (112, 14), (8, 4)):
        index, cu = geometry.window_partition(g, 2, window_size, patch)
        ref_index, ref_cu = vision_utils.get_vision_window_index(g, 2, window_size, patch)
        assert torch.equal(index, ref_index), (grid, window_size)
        assert cu == ref_cu.tolist(), (grid, window_size)
    n = int(g.prod(-1).sum())
    order = geometry.patch_order(index, 2)
    assert sorted(order.tolist()) == list(range(n))  # a permutation of the patches
    x = torch.randn(n, 3)
    ref = x.reshape(n // 4, 4, -1)[index].reshape(n, -1)  # HF's permute_input_for_window_attn
    assert torch.equal(x[order], ref)


def test_vision_rope_angles_equal_hf_cos_sin():
    cfg = tiny_vlm_config().vision_config
    rope = Qwen2_5_VLVisionRotaryEmbedding(cfg)
    inv = geometry.vision_rope_inv_freq(cfg.hidden_size // cfg.num_heads, 10000.0)
    assert torch.equal(inv, rope.inv_freq)
    hw = geometry.patch_hw_positions(torch.tensor(GRIDS[0]), 2)
    cos, sin = rope(torch.zeros(1), hw)
    angles = geometry.vision_rope_angles(hw, inv)
    assert angles.shape == (hw.shape[0], cfg.hidden_size // cfg.num_heads)
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


def test_patch_and_merge_shapes_match_the_image_processor():
    rng = np.random.default_rng(1)
    sizes = [(20, 37), (48, 40), (9, 9), (100, 7)]
    out = image_processor()(images=[rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes],
                            return_tensors="pt")
    grid, pv = out["image_grid_thw"], out["pixel_values"]
    spec = arch_spec(tiny_vlm_config()).vision
    assert pv.shape == (int(grid.prod(-1).sum()), spec.patch_dim)
    assert all(h % 2 == 0 and w % 2 == 0 for _, h, w in grid.tolist())
    counts = geometry.merged_token_counts(grid, 2)
    assert counts == (grid.prod(-1) // 4).tolist()
    # HF's merger: [N, c] -> [N / 4, out]; the tower's patch embedding as a linear map == Conv3d
    merger = Qwen2_5_VLPatchMerger(dim=64, context_dim=spec.hidden_size, spatial_merge_size=2)
    assert merger(torch.randn(pv.shape[0], spec.hidden_size)).shape == (sum(counts), 64)
    embed = Qwen2_5_VisionPatchEmbed(patch_size=4, temporal_patch_size=2, in_channels=3, embed_dim=spec.hidden_size)
    w = embed.proj.weight
    with torch.no_grad():
        assert torch.allclose(torch.nn.functional.linear(pv, w.reshape(w.shape[0], -1)), embed(pv), atol=1e-5)
    with pytest.raises(ValueError, match="multiple of spatial_merge_size"):
        geometry.merged_token_counts([[1, 3, 4]], 2)


def test_family_spec_of_qwen2_5_vl():
    spec = arch_spec(tiny_vlm_config())
    assert spec.model_type == "qwen2_5_vl" and spec.mrope_section == (2, 3, 3)
    assert (spec.num_layers, spec.hidden_size, spec.num_query_groups, spec.head_dim) == (2, 64, 2, 16)
    assert spec.add_qkv_bias and not spec.qk_layernorm and not spec.tie_word_embeddings
    assert spec.rope_theta == 1000.0 and spec.vocab_size == 160
    v = spec.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim, v.fullatt_block_indexes) == (2, 32, 2, 16, (1,))
    assert (v.patch_dim, v.merged_size, v.image_token_id) == (96, 128, 150)
    assert arch_spec(tiny_vlm_config(tie=True)).tie_word_embeddings
    # a 7B-style config: head_dim 128, sections [16, 24, 24]
    big = transformers.Qwen2_5_VLConfig(text_config=dict(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        rope_parameters={"rope_type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1e6}))
    assert arch_spec(big).mrope_section == (16, 24, 24) and arch_spec(big).rope_theta == 1e6
    bad = tiny_vlm_config()
    bad.text_config.rope_parameters["mrope_section"] = [2, 2, 2]
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        arch_spec(bad)
