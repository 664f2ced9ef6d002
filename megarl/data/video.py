"""Videos in prompt rows (vision-language models): frames and their timing, the checkpoint's video
processor settings, placeholder expansion and pixels, without torchvision.

A row's videos (field `data.video_key`, default ``videos``) are a list of videos (or one video
alone as a mapping); a video is a list of frames, or a mapping ``{"frames": [...], "fps": f}`` /
``{"frames": [...], "timestamps": [s0, s1, ...]}``. A frame is anything an image entry may be
(`megarl.data.images`: a path relative to the data file, a data URI or bare base64, a ``{bytes,
path}`` mapping). The frames are the video as sampled: all of them are used, in order; `fps` is the
rate they were sampled at (frame k at k / fps seconds), `timestamps` gives each frame's time
instead, and without either the video processor's own `fps` is assumed.

Processing follows the checkpoint's video processor (`video_preprocessor_config.json`, else
`preprocessor_config.json`; Qwen2.5-VL's `Qwen2VLVideoProcessor` or Qwen3-VL's
`Qwen3VLVideoProcessor` rules by model type, transformers 5.19):
- size: Qwen2.5-VL resizes every frame like an image (`smart_resize` of its height and width to
  multiples of p * m within [min, max] pixels); Qwen3-VL bounds the whole clip (t' * h * w within
  [min, max] pixels, t' the frame count rounded to the temporal patch size); both cap pixels per
  frame the reference way when `cap_pixels_per_frame` is set;
- frames are resized with PIL's bicubic filter (HF's video processors use torchvision's bicubic
  resize, which needs a torchvision build matching torch; transformers 5.19's `BaseVideoProcessor`
  cannot even be built without it), scaled by `rescale_factor` and normalised by the mean / std as
  HF fuses them, the frame count padded to a multiple of the temporal patch size by repeating the
  last frame, and patchified in HF's order: pixel_values_videos [t * h * w, C * tp * p * p] with
  video_grid_thw (t, h, w). Where frames already have the target size no resize happens, and the
  pixels are HF's own;
- placeholders: each `data.video_placeholder` (default ``<video>``) marks a video (videos without
  one go first). Qwen2.5-VL: ``<|vision_start|><|video_pad|><|vision_end|>``, the pad expanded to
  t * h * w / m^2 tokens, and `second_per_grid_ts` = temporal_patch_size / fps for M-RoPE.
  Qwen3-VL: per temporal patch j, ``<{time:.1f} seconds>`` (the mean time of its frames) then
  ``<|vision_start|><|video_pad|><|vision_end|>`` with the pad expanded to h * w / m^2 tokens, as
  HF's `Qwen3VLProcessor` writes it.

A video with a missing, unreadable or corrupt frame, frames of different sizes, more frames than
the processor's `max_frames`, or more tokens than `data.max_video_tokens` raises VideoError (an
ImageError: the row is skipped, counted and named like a row with a bad image).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.data.images import ImageError, ImageRef, image_refs, open_image

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# transformers 5.19's class defaults of the two video processors
_DEFAULTS = {
    False: dict(patch_size=14, size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
                image_mean=CLIP_MEAN, image_std=CLIP_STD, max_video_tokens=128000),
    True: dict(patch_size=16, size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
               image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), max_video_tokens=768),
}


class VideoError(ImageError):
    """A video of a row cannot be used (the message names the video)."""


@dataclass(frozen=True)
class VideoRef:
    """A row's video: its frames (`ImageRef`s), their timing and a label for messages."""

    label: str
    frames: tuple[ImageRef, ...]
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None


def video_refs(raw: Any, base_dir: str | Path) -> list[VideoRef]:
    """The row field's videos as `VideoRef`s (module doc); raises VideoError on a malformed entry."""
    entries = [raw] if isinstance(raw, dict) else raw if isinstance(raw, (list, tuple)) else None
    if entries is None:
        raise VideoError(f"videos: expected a list of videos, got {type(raw).__name__}")
    out = []
    for k, v in enumerate(entries):
        fps = stamps = None
        if isinstance(v, dict):
            fps, stamps, v = v.get("fps"), v.get("timestamps"), v.get("frames")
        if not isinstance(v, (list, tuple)) or not v:
            raise VideoError(f"video {k}: a video is a non-empty list of frames or a {{frames, fps | timestamps}} "
                             f"mapping, got {type(v).__name__}")
        try:
            frames = tuple(image_refs(list(v), base_dir))
        except ImageError as e:
            raise VideoError(f"video {k}: {e}") from e
        if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
            raise VideoError(f"video {k}: fps must be a positive number, got {fps!r}")
        if stamps is not None and (len(stamps) != len(frames) or any(not isinstance(s, (int, float)) for s in stamps)):
            raise VideoError(f"video {k}: timestamps must be {len(frames)} numbers, one per frame")
        out.append(VideoRef(label=f"video {k} ({frames[0].label}, {len(frames)} frames)", frames=frames,
                            fps=None if fps is None else float(fps),
                            timestamps=None if stamps is None else tuple(float(s) for s in stamps)))
    return out


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
                  temporal: int = 1) -> tuple[int, int]:
    """Height and width rounded to multiples of `factor` with frames' * h * w in [min, max] pixels
    (frames' = frames rounded to `temporal`; 1 for a per-frame bound), as HF's smart_resize."""
    if height < factor or width < factor:  # Qwen3-VL upscales tiny frames first
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(f"aspect ratio {max(height, width) / min(height, width):.0f} > 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class VideoSettings:
    """The video processor settings megarl applies (module doc)."""

    qwen3: bool  # Qwen3-VL rules (clip-level size bound, timestamp runs)
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    fps: float = 2.0
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, cfg: dict, qwen3: bool) -> "VideoSettings":
        d = {**_DEFAULTS[qwen3], **{k: v for k, v in cfg.items() if v is not None}}
        size = dict(d["size"])
        return cls(qwen3=qwen3, patch_size=int(d["patch_size"]), temporal_patch_size=int(d.get("temporal_patch_size", 2)),
                   merge_size=int(d.get("merge_size", 2)),
                   min_pixels=int(d.get("min_pixels") or size["shortest_edge"]),
                   max_pixels=int(d.get("max_pixels") or size["longest_edge"]),
                   mean=tuple(d["image_mean"]), std=tuple(d["image_std"]),
                   rescale_factor=float(d.get("rescale_factor", 1 / 255)), do_resize=bool(d.get("do_resize", True)),
                   do_rescale=bool(d.get("do_rescale", True)), do_normalize=bool(d.get("do_normalize", True)),
                   fps=float(d.get("fps") or 2.0), max_frames=int(d.get("max_frames", 768)),
                   cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame")),
                   max_video_tokens=int(d["max_video_tokens"]))

    @classmethod
    def from_pretrained(cls, hf_path: str | Path, model_type: str) -> "VideoSettings":
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = Path(hf_path) / name
            if path.is_file():
                return cls.from_dict(json.loads(path.read_text()), model_type.startswith("qwen3"))
        raise ValueError(f"{hf_path}: a video model needs video_preprocessor_config.json or preprocessor_config.json")

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a video of `frames` frames is resized to."""
        if not self.do_resize:
            return height, width
        factor, tp = self.patch_size * self.merge_size, self.temporal_patch_size
        max_px = self.max_pixels
        if self.cap_pixels_per_frame and self.qwen3:
            per = max(min(self.max_video_tokens * factor * factor, max_px // frames), int(self.min_pixels * 1.05))
            max_px = per * frames
        elif self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_px = max(min(max_px, total * tp // frames), int(self.min_pixels * 1.05))
        if self.qwen3:
            return _smart_resize(height, width, factor, self.min_pixels, max_px, frames, tp)
        return _smart_resize(height, width, factor, self.min_pixels, max_px)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patches of a video of `frames` frames of height x width pixels."""
        h, w = self.frame_size(frames, height, width)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size


def frame_times(ref: VideoRef, default_fps: float) -> list[float]:
    """Seconds of each frame: its timestamp, or k / fps."""
    if ref.timestamps is not None:
        return list(ref.timestamps)
    fps = ref.fps or default_fps
    return [k / fps for k in range(len(ref.frames))]


def patch_times(times: list[float], temporal_patch: int) -> list[float]:
    """Time of each temporal patch: the mean of its first and last frame's times, the frame list
    padded by repeating its last frame (HF's `Qwen3VLProcessor._calculate_timestamps`)."""
    times = list(times) + [times[-1]] * (-len(times) % temporal_patch)
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


def patchify(video: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """[frames, C, H, W] -> [t * h * w, C * tp * p * p] in HF's video patch order (frames padded to
    a multiple of the temporal patch by repeating the last one)."""
    if pad := -video.shape[0] % temporal:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    f, c, hh, ww = video.shape
    t, h, w = f // temporal, hh // patch, ww // patch
    x = video.view(t, temporal, c, h // merge, merge, patch, w // merge, merge, patch)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, c * temporal * patch * patch)


class VideoInputs:
    """A checkpoint's video settings and tokens: grids, token counts, placeholder text, pixels."""

    def __init__(self, settings: VideoSettings, video_token_id: int, vision_start_id: int, vision_end_id: int,
                 tokenizer, placeholder: str = "<video>", max_video_tokens: int | None = None):
        self.settings = settings
        self.video_token_id, self.placeholder, self.max_video_tokens = video_token_id, placeholder, max_video_tokens
        self.start, self.pad, self.end = tokenizer.convert_ids_to_tokens([vision_start_id, video_token_id, vision_end_id])

    @classmethod
    def from_pretrained(cls, hf_path: str | Path, hf_config, tokenizer, **kw) -> "VideoInputs | None":
        """The checkpoint's video settings and tokens; None for a model without a video token."""
        if getattr(hf_config, "video_token_id", None) is None:
            return None
        return cls(VideoSettings.from_pretrained(hf_path, hf_config.model_type), int(hf_config.video_token_id),
                   int(hf_config.vision_start_token_id), int(hf_config.vision_end_token_id), tokenizer, **kw)

    def refs(self, raw: Any, base_dir: str | Path) -> list[VideoRef]:
        return video_refs(raw, base_dir)

    def _frames(self, ref: VideoRef) -> list:
        if len(ref.frames) > self.settings.max_frames:
            raise VideoError(f"{ref.label}: {len(ref.frames)} frames > the video processor's max_frames "
                             f"{self.settings.max_frames}")
        frames = [open_image(f) for f in ref.frames]
        sizes = {im.size for im in frames}
        if len(sizes) > 1:
            raise VideoError(f"{ref.label}: frames of different sizes {sorted(sizes)}")
        return frames

    def run_tokens(self, ref: VideoRef) -> list[int]:
        """Placeholder tokens of each run of the video (Qwen3-VL: one run per temporal patch);
        raises VideoError when it is unusable or larger than max_video_tokens."""
        frames = self._frames(ref)
        t, h, w = self.settings.grid(len(frames), frames[0].height, frames[0].width)
        per = h * w // self.settings.merge_size ** 2
        runs = [per] * t if self.settings.qwen3 else [t * per]
        if self.max_video_tokens is not None and sum(runs) > self.max_video_tokens:
            raise VideoError(f"{ref.label}: {sum(runs)} tokens > data.max_video_tokens {self.max_video_tokens}")
        return runs

    def marker(self, ref: VideoRef) -> str:
        """The prompt text of one video, one pad per run (expanded after tokenisation)."""
        run = self.start + self.pad + self.end
        if not self.settings.qwen3:
            return run
        times = patch_times(frame_times(ref, self.settings.fps), self.settings.temporal_patch_size)
        return "".join(f"<{s:.1f} seconds>" + run for s in times)

    def pixels(self, refs: list[VideoRef]) -> dict[str, torch.Tensor]:
        """pixel_values_videos, video_grid_thw and second_per_grid_ts of a prompt's videos."""
        s = self.settings
        patches, grids, seconds = [], [], []
        mean, std = np.asarray(s.mean, dtype=np.float32), np.asarray(s.std, dtype=np.float32)
        for ref in refs:
            frames = self._frames(ref)
            h, w = s.frame_size(len(frames), frames[0].height, frames[0].width)
            arrays = []
            for im in frames:
                if (im.height, im.width) != (h, w):
                    from PIL import Image

                    im = im.resize((w, h), resample=Image.Resampling.BICUBIC)
                x = np.asarray(im, dtype=np.float32)
                if s.do_rescale and s.do_normalize:  # HF fuses both: (x - mean * (1 / r)) / (std * (1 / r))
                    x = (x - mean * (1.0 / s.rescale_factor)) / (std * (1.0 / s.rescale_factor))
                elif s.do_rescale:
                    x = x * s.rescale_factor
                elif s.do_normalize:
                    x = (x - mean) / std
                arrays.append(torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))))
            patches.append(patchify(torch.stack(arrays), s.patch_size, s.merge_size, s.temporal_patch_size))
            grids.append(list(s.grid(len(frames), frames[0].height, frames[0].width)))
            times = frame_times(ref, s.fps)
            fps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else (ref.fps or s.fps)
            seconds.append(s.temporal_patch_size / fps)
        return {"pixel_values_videos": torch.cat(patches).float(), "video_grid_thw": torch.tensor(grids, dtype=torch.long),
                "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}
