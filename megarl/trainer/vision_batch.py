"""A vision-language model's inputs of one packed row of sequences (`batch.build_microbatch`):
which tokens are image / video placeholders, the M-RoPE position ids and the rows' pixels.

Per sequence of the row (prompt p_1..p_P, response, padding to its packed width):
- `image_mask` / `video_mask` [1, S]: the image / video placeholders of the prompts that carry
  images or videos; a placeholder id anywhere else (a response, a text-only prompt) is text, as the
  engine embeds it;
- `position_ids` [3, 1, S] when some sequence of the row has images or videos: each prompt's
  M-RoPE ids as the engine computes them (`megarl.models.vision.mrope.vision_position_ids`: HF's
  `get_rope_index`, videos included), its response and padding continuing as text after the
  prompt's largest id (the engine's decode steps); a text-only sequence gets (p, p, p);
- the images and videos of the row's sequences, concatenated in sequence order (HF's layout):
  `pixel_values` / `image_grid_thw`, `pixel_values_videos` / `video_grid_thw`.
"""

from __future__ import annotations

import torch


def images_of(traj):
    """A Trajectory's images and videos as a `PromptImages` (None without either)."""
    from megarl.rollout.types import PromptImages

    if traj.pixel_values is None and not traj.videos:
        return None
    return PromptImages(traj.pixel_values, traj.image_grid_thw, **(traj.videos or {}))


def packed_vision(batch, rows: list[int], padded: list[int], vision) -> dict[str, torch.Tensor]:
    """The model inputs above for sequences `rows` of `batch` packed at widths `padded`; `vision`:
    the model's VisionSpec / Qwen3VisionSpec."""
    from megarl.data.images import concat_images
    from megarl.models.vision.mrope import vision_position_ids

    images = batch.images or [None] * len(batch)
    width_all = sum(padded)
    image_mask = torch.zeros(1, width_all, dtype=torch.bool)
    video_mask = torch.zeros(1, width_all, dtype=torch.bool)
    pos = torch.zeros(3, 1, width_all, dtype=torch.long)
    off = 0
    for i, width in zip(rows, padded):
        prompt, im = torch.tensor(batch.prompt_ids[i])[None], images[i]
        P = prompt.shape[1]
        if im is None:
            pos[:, 0, off : off + width] = torch.arange(width)
        else:
            ids, _ = vision_position_ids(prompt, vision, im.image_grid_thw, im.video_grid_thw, im.second_per_grid_ts)
            image_mask[0, off : off + P] = prompt[0] == vision.image_token_id
            if vision.video_token_id is not None:
                video_mask[0, off : off + P] = prompt[0] == vision.video_token_id
            pos[:, 0, off : off + P] = ids[:, 0]
            pos[:, 0, off + P : off + width] = int(ids.max()) + 1 + torch.arange(width - P)
        off += width
    out = {"image_mask": image_mask, "video_mask": video_mask}
    found = concat_images([images[i] for i in rows])
    if found is not None:
        out["position_ids"] = pos
        if found.pixel_values is not None:
            out.update(pixel_values=found.pixel_values, image_grid_thw=found.image_grid_thw)
        if found.pixel_values_videos is not None:
            out.update(pixel_values_videos=found.pixel_values_videos, video_grid_thw=found.video_grid_thw)
    return out
