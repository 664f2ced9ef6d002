"""Qwen3-VL index arithmetic (megarl.models.vision.qwen3_vl_geometry, qwen3_vl_model.deepstack_rows)
vs HF transformers 5.19 and vs direct readings of the formulas: the learned position table resampled
to each image grid, the interleaved M-RoPE frequency axes, and where DeepStack features land."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from megarl.models.vision.geometry import patch_hw_positions
from megarl.models.vision.qwen3_vl_geometry import (
    interleaved_mrope_angles, interleaved_mrope_axes, position_table_taps)
from megarl.models.vision.qwen3_vl_model import deepstack_rows

GRIDS = [[[1, 4, 10], [1, 12, 10], [1, 2, 2]], [[2, 6, 4], [1, 16, 16]], [[1, 48, 2]]]


@pytest.mark.parametrize("grids", GRIDS)
@pytest.mark.parametrize("side", [3, 6, 48])
def test_position_taps_equal_hf(grids, side):
    grid = torch.tensor(grids)
    idx, w = position_table_taps(grid, side, 2)
    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)


@pytest.mark.parametrize("grids", GRIDS)
def test_position_taps_are_bilinear_align_corners_interpolation(grids):
    side, channels = 6, 5
    table = torch.randn(side * side, channels, dtype=torch.float64)
    idx, w = position_table_taps(grids, side, 2)
    got = (table[idx] * w[..., None].double()).sum(1)
    hw = patch_hw_positions(grids, 2)
    want, start = [], 0
    for t, h, w_ in grids:
        image = F.interpolate(table.T.reshape(1, channels, side, side), size=(h, w_), mode="bilinear",
                              align_corners=True)[0]
        rc = hw[start: start + t * h * w_]
        want.append(image[:, rc[:, 0], rc[:, 1]].T)
        start += t * h * w_
    assert torch.allclose(got, torch.cat(want), atol=1e-6)
    # every frame of a video repeats its frame's positions
    if grids[0][0] == 2:
        n = grids[0][1] * grids[0][2]
        assert torch.equal(idx[:n], idx[n:2 * n])


def test_interleaved_axes_of_qwen3_vl_30b():
    axis = interleaved_mrope_axes([24, 20, 20], 64)
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2]
    assert axis[57:].tolist() == [0, 1, 2, 0, 0, 0, 0]  # h / w end at 3 * 20; t takes the tail
    assert torch.bincount(axis).tolist() == [24, 20, 20]


@pytest.mark.parametrize("section,head_dim", [([24, 20, 20], 128), ([6, 5, 5], 32), ([2, 3, 3], 16)])
def test_interleaved_angles_equal_hf_rotary(section, head_dim):
    cfg = transformers.Qwen3VLMoeTextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 5000.0})
    rotary = Qwen3VLMoeTextRotaryEmbedding(cfg)
    pos = torch.randint(0, 300, (3, 2, 17))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    angles = interleaved_mrope_angles(pos, rotary.inv_freq, interleaved_mrope_axes(section, head_dim // 2))
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)
    # Qwen2.5-VL's contiguous sections rotate differently: the comparison can tell them apart
    contiguous = torch.cat([torch.full((n,), a) for a, n in enumerate(section)])
    other = interleaved_mrope_angles(pos, rotary.inv_freq, contiguous)
    assert (other.cos() - cos).abs().max() > 1e-2


def test_deepstack_rows_add_features_where_hf_does():
    b, s, h = 3, 8, 4
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, s, h, generator=gen)
    mask = torch.rand(b, s, generator=gen) < 0.4
    features = torch.randn(int(mask.sum()), h, generator=gen)
    want = hidden.clone()
    want[mask] = want[mask] + features  # HF `_deepstack_process`, row-major over [b, s]
    megatron = hidden.transpose(0, 1).contiguous()  # [s, b, h]
    rows, picked = deepstack_rows(mask, sequence_parallel=False, tp=1, tp_rank=0)
    assert picked is None
    got = megatron.reshape(-1, h).index_add(0, rows, features).view(s, b, h)
    assert torch.equal(got.transpose(0, 1), want)
    slices = []  # sequence parallel over 2 ranks: each adds its slice's rows
    for rank in range(2):
        part = megatron[rank * s // 2: (rank + 1) * s // 2]
        rows, picked = deepstack_rows(mask, sequence_parallel=True, tp=2, tp_rank=rank)
        slices.append(part.reshape(-1, h).index_add(0, rows, features[picked]).view_as(part))
    assert torch.equal(torch.cat(slices).transpose(0, 1), want)
