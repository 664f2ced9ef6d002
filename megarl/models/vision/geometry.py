"""Pure index arithmetic of the Qwen2.5-VL vision tower (no weights, no megatron).

An image (or video) enters as `grid_thw = (t, h, w)` patches of `temporal_patch_size x patch_size
x patch_size` pixels, flattened by HF's image processor into rows of `pixel_values` in
merge-block-major order: for merge size m, the patches of each m x m block are consecutive, blocks
row-major, frames outermost. The patch merger turns each m x m block into one LLM token, so an
image contributes `t * h * w / m^2` placeholder tokens.

Everything here equals what transformers 5.19 computes (`transformers.vision_utils` and
`Qwen2_5_VisionTransformerPretrainedModel.forward`); `tests/unit/test_vlm_geometry.py` checks it.
"""

from __future__ import annotations

import torch


def _grids(grid_thw) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def merged_token_counts(grid_thw, merge: int) -> list[int]:
    """LLM tokens per image: t * h * w / m^2 (h and w must be multiples of m)."""
    out = []
    for t, h, w in _grids(grid_thw):
        if h % merge or w % merge:
            raise ValueError(f"image grid (t={t}, h={h}, w={w}) is not a multiple of spatial_merge_size={merge}")
        out.append(t * h * w // merge**2)
    return out


def patch_cu_seqlens(grid_thw) -> list[int]:
    """Boundaries of full attention: every frame of every image is one segment of h * w patches,
    cu = [0, h1 w1, ..., sum_i t_i h_i w_i] (a frame of t_i repeated t_i times)."""
    cu = [0]
    for t, h, w in _grids(grid_thw):
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def patch_hw_positions(grid_thw, merge: int) -> torch.Tensor:
    """(row, column) of every patch in pixel_values order, [N, 2] long.

    For patch k of frame f of an image with grid (t, h, w): write k = ((bi * (w/m) + bj) * m + i) * m
    + j (block row bi, block column bj, offsets i, j < m); then row = bi * m + i, col = bj * m + j.
    """
    out = []
    for t, h, w in _grids(grid_thw):
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def window_partition(grid_thw, merge: int, window_size: int, patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """(window_index, cu_window_seqlens) of the windowed-attention layers.

    Windows are squares of W = window_size / merge / patch_size merged tokens (W*m patches a side)
    tiling each frame's (h/m) x (w/m) grid of merge blocks from the top-left; edge windows are cut.
    window_index [B] (B = number of merge blocks) lists the merge blocks window by window (row-major
    inside a window, windows row-major, frames then images in order), as indices into the blocks
    in pixel_values order; cu_window_seqlens are the window boundaries in patches (m^2 per block),
    with empty windows dropped.
    """
    win = window_size // merge // patch_size
    if win < 1:
        raise ValueError(f"window_size={window_size} is smaller than spatial_merge_size * patch_size")
    index, cu, base = [], [0], 0
    for t, h, w in _grids(grid_thw):
        gh, gw = h // merge, w // merge
        blocks = torch.arange(t * gh * gw).view(t, gh, gw)
        nh, nw = -(-gh // win), -(-gw // win)
        for f in range(t):
            for a in range(nh):
                for b in range(nw):
                    part = blocks[f, a * win:(a + 1) * win, b * win:(b + 1) * win].flatten()
                    if part.numel():
                        index.append(part + base)
                        cu.append(cu[-1] + part.numel() * merge**2)
        base += t * gh * gw
    return (torch.cat(index) if index else torch.zeros(0, dtype=torch.long)), cu


def patch_order(window_index: torch.Tensor, merge: int) -> torch.Tensor:
    """Patch permutation of the window layout: patch p' = order[p] of pixel_values order sits at
    position p, where block window_index[p // m^2] contributes its m^2 patches in order."""
    unit = merge**2
    return (window_index[:, None] * unit + torch.arange(unit)[None]).flatten()


def vision_rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Axial 2D RoPE frequencies: inv_freq[i] = 1 / theta^(2i / (head_dim/2)), i < head_dim/4."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def vision_rope_angles(hw: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotation angles [N, head_dim] of patches at (row, col) = hw [N, 2]:
    a = [row * inv_freq, col * inv_freq]  (head_dim/2),  angles = [a, a]  (rotate-half layout)."""
    a = (hw[..., None].float() * inv_freq.float()).flatten(-2)
    return torch.cat([a, a], dim=-1)
