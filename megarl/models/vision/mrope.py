"""M-RoPE (multimodal rotary) position ids of Qwen2-VL / Qwen2.5-VL, as HF's `get_rope_index`.

Every token gets three position ids (temporal, height, width); the LLM's rotary frequencies are
split into `mrope_section = [s_t, s_h, s_w]` chunks (s_t + s_h + s_w = head_dim / 2) and chunk c
rotates by position id c (megatron's `MultimodalRotaryEmbedding`, HF's `Qwen2_5_VLRotaryEmbedding`).

For one sequence, walking left to right with a running offset p (start 0):
- a text token gets (p, p, p), then p += 1;
- a run of image placeholder tokens is one image with grid (t, h, w) (the next of `image_grid_thw`,
  images consumed in order over the batch) and merge size m: its t * (h/m) * (w/m) tokens, in
  row-major (frame, row, column) order, get (p + f, p + i, p + j) for frame f, merged row i,
  merged column j (a still image's temporal step is 1, HF's fix for #45325);
  then p += max(h, w) / m.
Left/right padding (attention_mask == 0) is skipped and gets position 0. The rope delta of a row is
max(position) + 1 - (number of unmasked tokens): generated tokens continue at n + delta.

Videos (tokens_per_second temporal scaling) are not supported: phase 1 is images.
"""

from __future__ import annotations

import torch


def _runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """[(is_image, start, end)] maximal runs of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[3, t*(h/m)*(w/m)] positions (start + f, start + i, start + j) of one image's tokens."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    f = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
    i = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    j = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([f, i, j]).reshape(3, -1) + start


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw, image_token_id: int, merge: int,
                       attention_mask: torch.Tensor | None = None,
                       video_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, b, s] long, rope_deltas [b, 1]) for input_ids [b, s] (module doc).

    image_grid_thw [n_images, 3] lists the images of all rows in order; every run of image tokens
    must hold exactly one image's t*h*w/m^2 tokens (ValueError otherwise, as HF cannot place it)."""
    ids = input_ids.detach().cpu()
    if ids.dim() == 1:
        ids = ids[None]
    if video_token_id is not None and bool((ids == video_token_id).any()):
        raise ValueError("video tokens are not supported by megarl's Qwen2.5-VL (images only)")
    grids = iter([tuple(int(x) for x in g) for g in (image_grid_thw.tolist() if image_grid_thw is not None else [])])
    b, s = ids.shape
    pos = torch.zeros(3, b, s, dtype=torch.long)
    deltas = []
    for r in range(b):
        keep = torch.ones(s, dtype=torch.bool) if attention_mask is None else attention_mask[r].detach().cpu().bool()
        row = ids[r][keep]
        parts, p = [], 0
        for is_image, a, e in _runs((row == image_token_id).tolist()):
            if not is_image:
                parts.append(torch.arange(p, p + e - a).expand(3, -1))
                p += e - a
                continue
            grid = next(grids, None)
            if grid is None:
                raise ValueError(f"row {r} has more image-token runs than image_grid_thw has images")
            n = grid[0] * (grid[1] // merge) * (grid[2] // merge)
            if e - a != n:
                raise ValueError(f"row {r}: an image-token run of {e - a} tokens at {a} does not match the "
                                 f"image's grid {grid} ({n} tokens); separate images by text tokens")
            parts.append(image_positions(p, grid, merge))
            p += max(grid[1], grid[2]) // merge
        flat = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        pos[:, r, keep] = flat
        deltas.append((int(flat.max()) + 1 if flat.numel() else 0) - int(row.numel()))
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more images than the input_ids have image-token runs")
    return pos, torch.tensor(deltas, dtype=torch.long)[:, None]
