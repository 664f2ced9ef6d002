"""Images in prompt rows (vision-language models): loading, checking, placeholder expansion, pixels.

A row's images (field `data.image_key`, default ``images``) are a list, or one entry, each either
- a file path, relative to the data file's directory (or absolute),
- a data URI (``data:image/png;base64,...``) or a bare base64 string of an encoded image (one
  longer than 1024 characters: shorter strings are paths),
- a mapping with ``bytes`` (encoded image) or ``path`` (HF ``datasets`` Image columns in parquet).

The prompt text marks where each image goes with `data.image_placeholder` (default ``<image>``),
one marker per image in order; a prompt with images but no marker gets them at its start. Each
marker becomes ``<|vision_start|><|image_pad|><|vision_end|>`` before templating, and after
tokenisation the single pad token of image k becomes n_k pads, n_k = t * (h / p) * (w / p) / m^2
for the image's grid after the processor's own resize (`smart_resize`: sides rounded to p * m,
area kept within the processor's min / max pixels) -- the layout HF's processor produces, and
the one the model's placeholder scatter and M-RoPE ids expect.

A row whose image is missing, unreadable, corrupt or larger than `data.max_image_tokens` tokens is
skipped and counted with its row number, id and the image's source (`PromptDataset.skipped`);
prompts whose image tokens push them past `data.max_prompt_len` are skipped as too long. Pixel
values are computed when a prompt is drawn (`ImageInputs.pixels`), not at load.

Videos (`data.video_key`, `<video>` placeholders; `megarl.data.video`) ride along: `ImageInputs`
holds the checkpoint's `VideoInputs` when it has one, a row's refs are its images then its videos,
and counts, markers, expansion and pixels cover both.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.rollout.types import PromptImages

BARE_BASE64_MIN = 1024


class ImageError(ValueError):
    """An image of a row cannot be used (the message names the image's source)."""


@dataclass(frozen=True)
class ImageRef:
    """A row's image: a resolved file path, or the encoded bytes (base64 / parquet), and its
    label for messages (the path, or ``base64 image k``)."""

    label: str
    path: str | None = None
    data: bytes | None = None


def image_refs(raw: Any, base_dir: str | Path) -> list[ImageRef]:
    """The row field's images as `ImageRef`s (module doc for the accepted forms); raises ImageError
    on a malformed entry."""
    entries = raw if isinstance(raw, (list, tuple)) else [raw]
    refs = []
    for k, e in enumerate(entries):
        if isinstance(e, dict):
            if isinstance(e.get("bytes"), (bytes, bytearray)) and e["bytes"]:
                refs.append(ImageRef(label=str(e.get("path") or f"image {k} (bytes)"), data=bytes(e["bytes"])))
                continue
            e = e.get("path")
        if not isinstance(e, str) or not e.strip():
            raise ImageError(f"image {k}: expected a path, a base64 string or a {{bytes|path}} mapping, got "
                             f"{type(e).__name__}")
        if e.startswith("data:"):
            head, _, payload = e.partition(",")
            if ";base64" not in head:
                raise ImageError(f"image {k}: data URI {head[:40]!r} is not base64")
            refs.append(ImageRef(label=f"base64 image {k}", data=_b64(payload, k)))
        elif len(e) > BARE_BASE64_MIN:  # no file path is that long
            refs.append(ImageRef(label=f"base64 image {k}", data=_b64(e, k)))
        else:
            p = Path(e)
            refs.append(ImageRef(label=e, path=str(p if p.is_absolute() else Path(base_dir) / p)))
    return refs


def _b64(payload: str, k: int) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"base64 image {k}: not valid base64 ({e})") from e


def open_image(ref: ImageRef):
    """The image as an RGB PIL image (decoded fully, so truncated files fail here)."""
    from PIL import Image, UnidentifiedImageError

    try:
        src = io.BytesIO(ref.data) if ref.data is not None else open(ref.path, "rb")
    except OSError as e:
        raise ImageError(f"image {ref.label!r}: {e.strerror or e}") from e
    try:
        with src, Image.open(src) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"image {ref.label!r}: not a readable image ({e})") from e


class ImageInputs:
    """A checkpoint's image processor and its vision tokens: counts, placeholder expansion, pixels.

    `processor`: the checkpoint's image processor (`AutoImageProcessor`; patch_size p, merge_size m,
    temporal_patch_size, size {shortest_edge: min pixels, longest_edge: max pixels});
    `image_token_id` / `vision_start_id` / `vision_end_id`: the model config's ids."""

    def __init__(self, processor, image_token_id: int, vision_start_id: int, vision_end_id: int,
                 tokenizer, placeholder: str = "<image>", max_image_tokens: int | None = None,
                 videos=None, video_key: str = "videos"):
        self.processor = getattr(processor, "image_processor", processor)
        self.image_token_id, self.start_id, self.end_id = image_token_id, vision_start_id, vision_end_id
        self.placeholder, self.max_image_tokens = placeholder, max_image_tokens
        self.marker = "".join(tokenizer.convert_ids_to_tokens([vision_start_id, image_token_id, vision_end_id]))
        self.videos, self.video_key = videos, video_key  # megarl.data.video.VideoInputs (None: no videos)

    @classmethod
    def from_pretrained(cls, hf_path: str, hf_config, tokenizer, **kw) -> "ImageInputs":
        """The checkpoint's image processor; `videos` (a `VideoInputs.from_pretrained`) in `kw`."""
        from transformers import AutoImageProcessor

        try:  # the image processor alone: AutoProcessor would also build a video processor (torchvision)
            processor = AutoImageProcessor.from_pretrained(hf_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{hf_path}: a vision-language model needs its processor files "
                             f"(preprocessor_config.json): {e}") from e
        return cls(processor, int(hf_config.image_token_id), int(hf_config.vision_start_token_id),
                   int(hf_config.vision_end_token_id), tokenizer, **kw)

    def row_visuals(self, row: dict, image_key: str) -> Any:
        """A row's raw images (`image_key`) and videos (`video_key`), None when it has neither."""
        raw_videos = row.get(self.video_key) if self.videos is not None else None
        if raw_videos is None:
            return row.get(image_key)
        return {"images": row.get(image_key), "videos": raw_videos}

    def refs(self, raw: Any, base_dir: str | Path) -> list:
        """`ImageRef`s, then `VideoRef`s, of `row_visuals`' value."""
        if not (isinstance(raw, dict) and "videos" in raw and "images" in raw):
            return image_refs(raw, base_dir)
        images = image_refs(raw["images"], base_dir) if raw["images"] is not None else []
        return images + self.videos.refs(raw["videos"], base_dir)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patches of one image after the processor's resize."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision needed

        p, m = int(self.processor.patch_size), int(self.processor.merge_size)
        size = self.processor.size
        min_px = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
        max_px = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        h, w = smart_resize(height, width, factor=p * m, min_pixels=min_px, max_pixels=max_px)
        return 1, h // p, w // p

    def n_tokens(self, image) -> int:
        """Image placeholder tokens of a PIL image: t * h * w / m^2."""
        t, h, w = self.grid(image.height, image.width)
        return t * h * w // int(self.processor.merge_size) ** 2

    def with_markers(self, prompt: str, refs) -> str:
        """The prompt with each placeholder replaced by the vision marker tokens' text (images, then
        videos, without a placeholder go first); `refs`: the row's refs (or its number of images).
        Raises ImageError when there are more placeholders than images or videos."""
        images = refs if isinstance(refs, int) else sum(isinstance(r, ImageRef) for r in refs)
        videos = [] if isinstance(refs, int) else [r for r in refs if not isinstance(r, ImageRef)]
        marks = [(self.placeholder, images, "image")]
        if self.videos is not None:
            marks.append((self.videos.placeholder, len(videos), "video"))
        for mark, n, what in reversed(marks):
            n_marks = prompt.count(mark)
            if n_marks > n:
                raise ImageError(f"the prompt has {n_marks} {mark!r} placeholders but the row has {n} {what}(s)")
            prompt = mark * (n - n_marks) + prompt
        prompt = prompt.replace(self.placeholder, self.marker)
        for video in videos:
            prompt = prompt.replace(self.videos.placeholder, self.videos.marker(video), 1)
        return prompt

    def expand(self, ids: list[int], counts: list) -> list[int]:
        """Token ids with the k-th image pad token repeated counts[k] times; a video's count is a
        list (one per run of its pads)."""
        ids = _expand(ids, self.image_token_id, [n for n in counts if isinstance(n, int)], "image")
        runs = [n for c in counts if not isinstance(c, int) for n in c]
        return _expand(ids, self.videos.video_token_id, runs, "video") if self.videos is not None else ids

    def check(self, refs: list) -> list:
        """Token count of each image (a list per video: its runs); raises ImageError (naming the
        image or video) when one is unusable."""
        counts = []
        for ref in refs:
            if not isinstance(ref, ImageRef):
                counts.append(self.videos.run_tokens(ref))
                continue
            n = self.n_tokens(open_image(ref))
            if self.max_image_tokens is not None and n > self.max_image_tokens:
                raise ImageError(f"image {ref.label!r}: {n} tokens > data.max_image_tokens {self.max_image_tokens}")
            counts.append(n)
        return counts

    def pixels(self, refs: list) -> PromptImages:
        """The processor's pixel_values [patches, C*tp*p*p] and image_grid_thw [n, 3] of a prompt's
        images, and its videos' pixels (`VideoInputs.pixels`)."""
        images = [r for r in refs if isinstance(r, ImageRef)]
        videos = [r for r in refs if not isinstance(r, ImageRef)]
        out = self.processor(images=[open_image(r) for r in images], return_tensors="pt") if images else None
        return PromptImages(pixel_values=None if out is None else out["pixel_values"].float(),
                            image_grid_thw=None if out is None else out["image_grid_thw"].long(),
                            **(self.videos.pixels(videos) if videos else {}))


def _expand(ids: list[int], pad: int, counts: list[int], what: str) -> list[int]:
    """Token ids with the k-th `pad` token repeated counts[k] times."""
    pads = [i for i, t in enumerate(ids) if t == pad]
    if len(pads) != len(counts):
        raise ImageError(f"the tokenised prompt holds {len(pads)} {what} pad tokens for {len(counts)} {what} run(s)")
    out, prev = [], 0
    for i, n in zip(pads, counts):
        out += ids[prev:i] + [pad] * n
        prev = i + 1
    return out + ids[prev:]


def concat_images(images: list[PromptImages | None]) -> PromptImages | None:
    """The images and videos of several sequences in sequence order (HF's row-major layout), None
    if none."""
    real = [im for im in images if im is not None]
    if not real:
        return None

    def cat(field):
        parts = [getattr(im, field) for im in real if getattr(im, field) is not None]
        return torch.cat(parts) if parts else None

    return PromptImages(*(cat(f) for f in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                           "second_per_grid_ts")))
