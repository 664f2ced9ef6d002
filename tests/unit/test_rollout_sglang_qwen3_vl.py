"""The SGLang engine's requests for Qwen3-VL-MoE with images and videos, and its routed experts
(megarl.rollout.sglang), through the stand-in `sglang.Engine` of tests/unit/test_rollout_sglang.py
(it reproduces SGLang's per-request normalisation and generates with the builtin engine).

A mixed batch (text only, one image, a video, an image and a video): each request gets exactly its
own processor-output item in `image_data` and in `video_data` (none for the other modality), in
both of FIRE's calls; the samples keep their inputs; the routed experts SGLang returns for every
token, image and video tokens included, are the builtin engine's own for the same sample."""

from __future__ import annotations

import torch

from megarl.rollout import SamplingParams
from megarl.rollout.types import PromptImages
from tests.distributed.scripts_qwen3_vl_common import make_prompt, make_tiny_qwen3_vl
from tests.unit.test_rollout_sglang import _engine, _StandInEngine


def test_images_videos_and_routed_experts_reach_each_request(tmp_path):
    from megarl.rollout.sglang.engine import video_data

    path = make_tiny_qwen3_vl(tmp_path / "hf", seed=3)
    _StandInEngine.created.clear()
    made = [make_prompt(seed=1), make_prompt([(20, 37)], seed=2), make_prompt(video=(2, 4, 6), seed=3),
            make_prompt([(16, 16)], video=(3, 4, 4), seed=4)]
    images = [None if im is None else PromptImages(im.get("pixel_values"), im.get("image_grid_thw"),
                                                   im.get("pixel_values_videos"), im.get("video_grid_thw"))
              for _, im in made]
    engine = _engine(path, return_routed_experts=True)
    engine.start()
    samples = engine.generate([p for p, _ in made], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=3,
                                                                    fire=True), images=images)
    (sgl,) = _StandInEngine.created
    first = slice(0, len(made))
    assert [r is not None for r in sgl.image_requests[first]] == [False, True, False, True]
    assert [r is not None for r in sgl.video_requests[first]] == [False, False, True, True]
    assert len(sgl.video_requests) == 2 * len(made)  # FIRE's second call carried the videos too
    (item,) = sgl.video_requests[3]
    assert item["pixel_values_videos"] is images[3].pixel_values_videos and item["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert video_data([images[1]]) == [[]]
    backend = sgl.backend
    for s in samples:
        assert s.images is images[s.index]
        n = len(s.prompt_ids) + len(s.response_ids)
        assert s.routed_experts.shape == (n, 3, 2)
        # the builtin engine's experts for the same prompt + response (re-prefilled by a continuation)
        ref = backend.continue_samples([_truncated(s)], SamplingParams(temperature=0.0,
                                                                        max_new_tokens=len(s.response_ids)))[0]
        assert torch.equal(s.routed_experts[: n - 1], ref.routed_experts[: n - 1])


def _truncated(s):
    """The sample minus its last token, as a T-PPO truncated sample (continue_samples re-prefills
    prompt + response and records their experts)."""
    import dataclasses

    return dataclasses.replace(s, response_ids=s.response_ids[:-1], logprobs=s.logprobs[:-1],
                               finish_reason="truncated", routed_experts=None)
