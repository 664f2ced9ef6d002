"""Pure index arithmetic of Qwen3-VL (no weights, no megatron): the learned position table
resampled to each image's grid, and the interleaved M-RoPE frequency assignment of the LLM.

Everything here equals what transformers 5.19 computes (`vision_utils.
get_vision_interpolation_indices_and_weights` with bilinear / align_corners=True, and
`Qwen3VLMoeTextRotaryEmbedding.recomposition_frequencies`); `tests/unit/test_vlm_qwen3_geometry.py`
checks both against HF and against `F.interpolate` / a direct reading of the formula.
"""

from __future__ import annotations

import torch

from megarl.models.vision import geometry


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights (1 - |src - tap|) on one axis
    for target positions `index` of an axis of `size` positions: src = index (side - 1) / max(size - 1, 1)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_table_taps(grid_thw, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [N, 4] long, weights [N, 4] float32) resampling a side x side learned position table
    (row-major rows of `pos_embed.weight`) to every patch in pixel_values order:

        pos(patch) = sum_k weights[k] * table[indices[k]]

    is F.interpolate(table as a [C, side, side] image, (h, w), "bilinear", align_corners=True) at the
    patch's (row, col) (`geometry.patch_hw_positions`), with the taps in the order (y0, x0), (y0, x1),
    (y1, x0), (y1, x1) HF sums them in. Every frame of an image repeats the frame's positions."""
    grids = [[int(x) for x in g] for g in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
    hw = geometry.patch_hw_positions(grids, merge)
    sizes = torch.tensor([(h, w) for t, h, w in grids for _ in range(t * h * w)], dtype=torch.long).reshape(-1, 2)
    h_taps, h_weights = _axis_taps(hw[:, 0], sizes[:, 0], side)
    w_taps, w_weights = _axis_taps(hw[:, 1], sizes[:, 1], side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def interleaved_mrope_axes(section, half: int) -> torch.Tensor:
    """Position axis (0 = t, 1 = h, 2 = w) of each of the `half` = head_dim / 2 rotary frequencies of
    Qwen3-VL's interleaved M-RoPE, section = (s_t, s_h, s_w):

        axis[i] = 1 if i = 1 (mod 3) and i < 3 s_h;  2 if i = 2 (mod 3) and i < 3 s_w;  0 otherwise.

    (Qwen2-VL / Qwen2.5-VL instead give the first s_t frequencies to t, the next s_h to h, the last
    s_w to w.)"""
    axis = torch.zeros(half, dtype=torch.long)
    axis[1: 3 * section[1]: 3] = 1
    axis[2: 3 * section[2]: 3] = 2
    return axis


def interleaved_mrope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Rotation angles [b, s, 2 * half] for M-RoPE ids [3, b, s]: a[..., i] = pos[axis[i]] * inv_freq[i],
    angles = [a, a] (rotate-half layout)."""
    freqs = position_ids[..., None].float() * inv_freq.float()  # [3, b, s, half]
    index = axis.to(freqs.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
    a = freqs.gather(0, index)[0]
    return torch.cat([a, a], dim=-1)
