"""The RolloutEngine contract (docs/design.md, "Contracts"): requests, sampling parameters, samples.

Every engine (builtin torch engine, colocated SGLang) speaks only HF names and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "truncated"]


@dataclass
class SamplingParams:
    """Sampling parameters of one generate call.

    temperature 0 means greedy. top_k <= 0 and top_p >= 1 disable those filters.
    FIRE (docs/algorithms.md §9): the first response token is sampled at `fire_temperature` with
    top-k `fire_top_k` (or the regular top_k if that is > 0); the rest at the regular settings.
    `window` (T-PPO): stop after this many new tokens with finish_reason "truncated"; the
    sample can be continued later with `continue_samples`. `return_routing`: MoE engines record
    the experts of every token (routing replay) only when true (evaluation turns it off).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    fire: bool = False
    fire_temperature: float = 30.0
    fire_top_k: int = 16
    window: int | None = None
    return_routing: bool = True

    def validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.fire_temperature > 0, "fire_temperature must be > 0"),
            (self.window is None or self.window >= 1, "window must be >= 1"),
            (isinstance(self.top_k, int), "top_k must be an int (<= 0 disables it)"),
            (self.fire_top_k >= 1, "fire_top_k must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative ints"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an int or None"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {msg} (got {self})")


@dataclass
class PromptImages:
    """The images and videos of one prompt (vision-language models), as HF's image / video
    processors return them for that prompt's images and videos in prompt order: `pixel_values`
    [patches, C * temporal_patch * patch^2] and `image_grid_thw` [images, 3] (None without images);
    `pixel_values_videos` / `video_grid_thw` the same for videos, and `second_per_grid_ts` [videos]
    the seconds one temporal patch spans (Qwen2.5-VL's M-RoPE; None: 1 s, and unused by Qwen3-VL).
    The prompt holds each image as one run of t * h * w / merge^2 image placeholder tokens, each
    video as one run of video placeholder tokens (Qwen3-VL: one run per temporal patch, after its
    timestamp), in the same order."""

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    def video_fields(self) -> dict[str, torch.Tensor]:
        """The video tensors that are set, by field name ({} without videos)."""
        return {k: getattr(self, k) for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
                if getattr(self, k) is not None}


@dataclass
class Sample:
    """One generated response.

    `logprobs[i]` is the log-probability of `response_ids[i]` under the distribution it was
    sampled from (after temperature / top-k / top-p). `finish_reason`: "stop" (EOS, stop token or
    stop string), "length" (max_new_tokens reached), "truncated" (T-PPO window reached; may be
    continued).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""
    index: int = 0  # which prompt of the request list this sample belongs to
    meta: dict = field(default_factory=dict)
    # MoE engines: [prompt + response tokens, layers, top_k] int16 experts each token was routed to
    # (routing replay); None when not recorded
    routed_experts: torch.Tensor | None = None
    # vision-language models: the prompt's images (None for text); `continue_samples` reuses them
    images: PromptImages | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """Samples `sampling.n` responses per prompt, prompt-major order. Engines that serve
        vision-language models also take `images=` (one `PromptImages` or None per prompt)."""

    def continue_samples(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Continues truncated samples (T-PPO) under the current weights."""

    def update_weights(self, stream: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Loads full HF-named tensors, delivered as buckets of (name, tensor)."""

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...
