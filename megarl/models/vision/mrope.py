"""M-RoPE (multimodal rotary) position ids of Qwen2-VL / Qwen2.5-VL / Qwen3-VL, as HF's `get_rope_index`.

Every token gets three position ids (temporal, height, width); the LLM's rotary frequencies are
split over those axes by `mrope_section` (contiguous chunks in Qwen2.5-VL, megatron's
`MultimodalRotaryEmbedding`; interleaved in Qwen3-VL, `qwen3_vl_geometry`).

For one sequence, walking left to right with a running offset p (start 0), over maximal runs of
text, image-placeholder and video-placeholder tokens:
- a text token gets (p, p, p), then p += 1;
- an image run is the next image of `image_grid_thw` (grid (t, h, w), merge size m): its
  t * (h/m) * (w/m) tokens, in row-major (frame, row, column) order, get (p + f, p + i, p + j)
  for frame f, merged row i, merged column j (a still image's temporal step is 1, HF's fix for
  #45325); then p += max(h, w) / m;
- a video run is the next video of `video_grid_thw`, placed like an image except that frame f's
  temporal id is p + floor(f * interval) with interval = tokens_per_second * second_per_grid_ts
  (Qwen2.5-VL: seconds per temporal patch = temporal_patch_size / fps); then p = (the run's
  largest id) + 1, which for an image is p + max(h, w) / m. Qwen3-VL writes each temporal patch of
  a video as its own run (a timestamp in text, then vision start, the patch's tokens, vision end):
  `video_frame_grids` splits each video's grid (t, h, w) into t grids (1, h, w), one per run, as
  HF does.

The text after a Qwen2.5-VL video whose temporal ids reach past its spatial ones
((t - 1) * interval > max(h, w) / m - 1) starts after the largest temporal id: Qwen's original
`get_rope_index` (transformers 4.x) and SGLang's do so, and so does every decode step of HF's
`generate` (rope delta). transformers 5.19's `get_rope_index` instead advances by max(h, w) / m
there, so its full-sequence forward of such a prompt disagrees with its own prefill + decode;
megarl follows the former everywhere (engine, trainer, conversion check). Images, Qwen3-VL videos
and videos whose temporal span fits their spatial one are placed identically by both.
Left/right padding (attention_mask == 0) is skipped and gets position 0. The rope delta of a row is
max(position) + 1 - (number of unmasked tokens): generated tokens continue at n + delta.
"""

from __future__ import annotations

import torch


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """[(type, start, end)] maximal runs of equal values."""
    runs, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


def image_positions(start: int, grid: tuple[int, int, int], merge: int, interval=1) -> torch.Tensor:
    """[3, t*(h/m)*(w/m)] positions (start + floor(f * interval), start + i, start + j) of one
    image's (interval 1) or video's tokens."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    f = (torch.arange(t) * interval).long().view(t, 1, 1).expand(t, gh, gw)
    i = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    j = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([f, i, j]).reshape(3, -1) + start


def video_frame_grids(video_grid_thw) -> torch.Tensor | None:
    """Qwen3-VL: each video grid (t, h, w) as t grids (1, h, w), one per temporal patch (HF's
    `get_rope_index` split: the patches are separate runs between timestamps)."""
    if video_grid_thw is None:
        return None
    grid = torch.as_tensor(video_grid_thw).reshape(-1, 3).long()
    out = grid.repeat_interleave(grid[:, 0], dim=0)
    out[:, 0] = 1
    return out


def _grid_list(grid_thw) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in g) for g in (torch.as_tensor(grid_thw).reshape(-1, 3).tolist()
                                               if grid_thw is not None else [])]


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw, image_token_id: int, merge: int,
                       attention_mask: torch.Tensor | None = None, video_token_id: int | None = None,
                       video_grid_thw=None, video_intervals=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, b, s] long, rope_deltas [b, 1]) for input_ids [b, s] (module doc).

    image_grid_thw [n_images, 3] / video_grid_thw [n_video_runs, 3] list the images / videos of all
    rows in order; `video_intervals` (one per video run, default 1) is each video's temporal step
    tokens_per_second * second_per_grid_ts. Every run must hold exactly its grid's t*h*w/m^2 tokens
    (ValueError otherwise, as HF cannot place it)."""
    ids = input_ids.detach().cpu()
    if ids.dim() == 1:
        ids = ids[None]
    grids = {1: iter(_grid_list(image_grid_thw)), 2: iter(_grid_list(video_grid_thw))}
    # float32 0-d tensors, as HF multiplies them (its processor's second_per_grid_ts is float32)
    intervals = iter(torch.as_tensor(video_intervals, dtype=torch.float32).reshape(-1)
                     if video_intervals is not None else [])
    names = {1: ("image", "image_grid_thw", "images"), 2: ("video", "video_grid_thw", "videos")}
    b, s = ids.shape
    pos = torch.zeros(3, b, s, dtype=torch.long)
    deltas = []
    for r in range(b):
        keep = torch.ones(s, dtype=torch.bool) if attention_mask is None else attention_mask[r].detach().cpu().bool()
        row = ids[r][keep]
        types = (row == image_token_id).long()
        if video_token_id is not None:
            types = torch.where(row == video_token_id, 2, types)
        parts, p = [], 0
        for kind, a, e in _runs(types.tolist()):
            if kind == 0:
                parts.append(torch.arange(p, p + e - a).expand(3, -1))
                p += e - a
                continue
            what, field, plural = names[kind]
            grid = next(grids[kind], None)
            if grid is None:
                raise ValueError(f"row {r} has more {what}-token runs than {field} has {plural}")
            n = grid[0] * (grid[1] // merge) * (grid[2] // merge)
            if e - a != n:
                raise ValueError(f"row {r}: an {what}-token run of {e - a} tokens at {a} does not match the "
                                 f"{what}'s grid {grid} ({n} tokens); separate {plural} by text tokens")
            interval = next(intervals, 1) if kind == 2 else 1
            parts.append(image_positions(p, grid, merge, interval))
            p = int(parts[-1].max()) + 1  # an image: p + max(h, w) / m
        flat = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        pos[:, r, keep] = flat
        deltas.append((int(flat.max()) + 1 if flat.numel() else 0) - int(row.numel()))
    for kind in (1, 2):
        if next(grids[kind], None) is not None:
            what, field, plural = names[kind]
            raise ValueError(f"{field} has more {plural} than the input_ids have {what}-token runs")
    return pos, torch.tensor(deltas, dtype=torch.long)[:, None]


def vision_position_ids(input_ids: torch.Tensor, vision, image_grid_thw=None, video_grid_thw=None,
                        second_per_grid_ts=None, attention_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mrope_position_ids` with the conventions of the model `vision` (a VisionSpec or
    Qwen3VisionSpec) describes: Qwen3-VL splits each video into one run per temporal patch;
    Qwen2.5-VL steps a video's frames by tokens_per_second * second_per_grid_ts (default 1 s)."""
    intervals = None
    if video_grid_thw is not None:
        if vision.video_frame_runs:
            video_grid_thw = video_frame_grids(video_grid_thw)
        else:
            n = torch.as_tensor(video_grid_thw).reshape(-1, 3).shape[0]
            seconds = (torch.ones(n) if second_per_grid_ts is None
                       else torch.as_tensor(second_per_grid_ts, dtype=torch.float32).reshape(-1))
            intervals = vision.tokens_per_second * seconds
    return mrope_position_ids(input_ids, image_grid_thw, vision.image_token_id, vision.spatial_merge_size,
                              attention_mask=attention_mask, video_token_id=vision.video_token_id,
                              video_grid_thw=video_grid_thw, video_intervals=intervals)
