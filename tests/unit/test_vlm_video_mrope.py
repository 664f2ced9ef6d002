"""M-RoPE position ids with videos (megarl.models.vision.mrope.vision_position_ids) against HF's
`get_rope_index`: Qwen3-VL (one run per temporal patch, timestamps between) and Qwen2.5-VL (one run,
temporal ids stepped by tokens_per_second x second_per_grid_ts), rows mixing text, images and
videos, with left padding; and the one placement where transformers 5.19 departs from Qwen's
original code (text after a Qwen2.5-VL video whose temporal span exceeds its spatial one)."""

from __future__ import annotations

import torch
import transformers

from megarl.models.families import arch_spec
from megarl.models.vision.mrope import vision_position_ids
from tests.distributed.scripts_qwen3_vl_common import VEND, make_prompt, mm_types, tiny_qwen3_vl_config
from tests.distributed.scripts_vlm_common import tiny_vlm_config


def rows(prompts):
    """Left-padded ids [b, s], attention mask, and the grids of all rows in order."""
    width = max(len(p) for p, _ in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in prompts])
    cat = lambda k: torch.cat([im[k] for _, im in prompts if im and k in im]) if any(im and k in im for _, im in prompts) else None  # noqa: E731
    return ids, mask, cat("image_grid_thw"), cat("video_grid_thw"), cat("second_per_grid_ts")


def test_qwen3_vl_video_positions_equal_hf():
    cfg = tiny_qwen3_vl_config(moe=False, layers=2)
    hf = transformers.Qwen3VLModel(cfg)
    prompts = [make_prompt([(20, 37)], video=(3, 4, 6), seed=1), make_prompt(video=(2, 8, 4), seed=2),
               make_prompt([(16, 16), (9, 9)], seed=3), make_prompt(seed=4)]
    ids, mask, image_grid, video_grid, _ = rows(prompts)
    ref, ref_delta = hf.get_rope_index(ids, mm_types(ids) * mask, image_grid, video_grid, attention_mask=mask)
    got, delta = vision_position_ids(ids, arch_spec(cfg).vision, image_grid, video_grid, attention_mask=mask)
    assert torch.equal(got, ref) and torch.equal(delta, ref_delta)


def test_qwen2_5_vl_video_positions_equal_hf_where_the_span_fits():
    cfg = tiny_vlm_config()
    hf = transformers.Qwen2_5_VLModel(cfg)
    prompts = [make_prompt([(20, 37)], video=(2, 6, 8), seed=1, frame_runs=False),
               make_prompt(video=(3, 8, 8), seed=2, frame_runs=False), make_prompt(seed=3)]
    prompts[0][1]["second_per_grid_ts"] = torch.tensor([0.5])  # 4 tokens / s x 0.5 s: temporal ids 0, 2
    prompts[1][1]["second_per_grid_ts"] = torch.tensor([0.25])
    ids, mask, image_grid, video_grid, seconds = rows(prompts)
    ref, ref_delta = hf.get_rope_index(ids, mm_types(ids) * mask, image_grid, video_grid, seconds, attention_mask=mask)
    got, delta = vision_position_ids(ids, arch_spec(cfg).vision, image_grid, video_grid, seconds, attention_mask=mask)
    assert torch.equal(got, ref) and torch.equal(delta, ref_delta)
    # teeth: another frame spacing changes the temporal ids
    other, _ = vision_position_ids(ids, arch_spec(cfg).vision, image_grid, video_grid, seconds * 2, attention_mask=mask)
    assert not torch.equal(other, ref)


def test_text_after_a_long_qwen2_5_vl_video_starts_after_its_last_temporal_id():
    cfg = tiny_vlm_config()
    ids, im = make_prompt(video=(3, 4, 6), seed=4, frame_runs=False)  # temporal 0, 4, 8 > spatial 0..2
    t = torch.tensor([ids])
    got, delta = vision_position_ids(t, arch_spec(cfg).vision, None, im["video_grid_thw"], im["second_per_grid_ts"])
    start, end = ids.index(151), ids.index(VEND)
    assert got[0, 0, start:end].unique().tolist() == [start, start + 4, start + 8]
    assert got[:, 0, end].tolist() == [start + 9] * 3  # Qwen's original rule and SGLang: max + 1
    assert int(delta) == int(got.max()) + 1 - len(ids)
    hf, _ = transformers.Qwen2_5_VLModel(cfg).get_rope_index(t, mm_types(t), None, im["video_grid_thw"],
                                                              im["second_per_grid_ts"])
    assert torch.equal(hf[:, :, :end], got[:, :, :end])  # the video itself agrees
    assert hf[0, 0, end] == start + 3  # transformers 5.19: + max(h, w) / m, overlapping the video's temporal ids
