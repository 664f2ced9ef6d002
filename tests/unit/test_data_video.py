"""Videos in prompt rows (megarl.data.video through megarl.data.images / dataset / sft /
trainer.build): the torchvision-free video path against transformers 5.19's own video processor
code, placeholder expansion for Qwen2.5-VL and Qwen3-VL, budgets, and bad videos skipped by name.

transformers 5.19's video processors cannot be built without torchvision (not installable for this
torch), so the comparisons run HF's own functions, read from its source files (`hf_function`):
Qwen3-VL's clip-level `smart_resize`, both processors' `patchify`, and `Qwen3VLProcessor`'s
timestamps."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megarl.data.video import VideoError, VideoSettings, _smart_resize, patch_times, patchify, video_refs


def hf_function(module: str, name: str, cls: str | None = None):
    """A function of a transformers module (a method of `cls`: called with self=None), compiled from
    the module's source file alone, so a module that needs torchvision still gives it."""
    path = Path(importlib.util.find_spec("transformers").origin).parent / "models" / module.replace(".", "/")
    tree = ast.parse(path.with_suffix(".py").read_text())
    body = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    ns = {"torch": torch, "math": math, "np": np}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], type_ignores=[])), str(path), "exec"), ns)
    return ns[name]


def png(path, h, w, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def test_video_refs_forms_and_errors(tmp_path):
    refs = video_refs([["a.png", "b.png"], {"frames": ["c.png"] * 3, "fps": 4},
                       {"frames": ["d.png", "e.png"], "timestamps": [0.0, 1.5]}], tmp_path)
    assert [len(r.frames) for r in refs] == [2, 3, 2] and refs[1].fps == 4.0 and refs[2].timestamps == (0.0, 1.5)
    assert refs[0].frames[0].path == str(tmp_path / "a.png")
    assert len(video_refs({"frames": ["a.png"], "fps": 2}, tmp_path)) == 1  # one video alone
    for bad, what in [(["a.png"], "a video is a non-empty list"), ([[]], "non-empty"),
                      ([{"frames": ["a.png"], "fps": 0}], "fps"),
                      ([{"frames": ["a.png", "b.png"], "timestamps": [1.0]}], "timestamps"), ("x.png", "list of videos")]:
        with pytest.raises(VideoError, match=what):
            video_refs(bad, tmp_path)


def test_resize_patch_order_and_timestamps_equal_hf():
    hf_resize = hf_function("qwen3_vl.video_processing_qwen3_vl", "smart_resize")
    hf_image_resize = hf_function("qwen2_vl.image_processing_pil_qwen2_vl", "smart_resize")
    for frames, h, w in [(3, 20, 37), (8, 48, 40), (2, 9, 9), (5, 100, 17), (16, 64, 64), (4, 7, 300)]:
        assert _smart_resize(h, w, 8, 512, 8 * 4096, frames, 2) == hf_resize(frames, h, w, 2, 8, 512, 8 * 4096)
        if min(h, w) >= 8:
            assert _smart_resize(h, w, 8, 256, 4096) == hf_image_resize(h, w, 8, 256, 4096)
    video = torch.randn(5, 3, 16, 24)  # 5 frames: padded to 6 by repeating the last
    for module, cls in (("qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
                        ("qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor")):
        ref, t, gh, gw = hf_function(module, "patchify", cls)(None, video[None], 4, 2, 2)
        assert (t, gh, gw) == (3, 4, 6) and torch.equal(patchify(video, 4, 2, 2), ref[0])
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for n, fps in [(3, 2.0), (8, 1.5), (1, 2.0)]:
        times = [k / fps for k in range(n)]
        assert patch_times(times, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(range(n)), fps, 2)


def test_settings_read_the_checkpoint_or_default_by_processor():
    q3 = VideoSettings.from_dict({"patch_size": 4, "size": {"shortest_edge": 512, "longest_edge": 32768}}, qwen3=True)
    assert (q3.mean, q3.max_frames, q3.fps, q3.min_pixels) == ((0.5, 0.5, 0.5), 768, 2.0, 512)
    q2 = VideoSettings.from_dict({"patch_size": 4, "min_pixels": 256, "max_pixels": 4096}, qwen3=False)
    assert q2.mean[0] == pytest.approx(0.48145466) and (q2.min_pixels, q2.max_pixels) == (256, 4096)
    # Qwen2.5-VL bounds each frame, Qwen3-VL the whole clip
    assert q2.grid(8, 64, 64) == (4, 16, 16) and q3.grid(8, 64, 64) == (4, 16, 16)
    assert q3.grid(16, 128, 128)[1] < q2.grid(16, 128, 128)[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megarl.tasks.tiny_qwen3_vl import TinyQwen3VLSpec, save_tiny_qwen3_vl
    from megarl.tasks.tiny_vlm import save_tiny_vlm

    root = tmp_path_factory.mktemp("video_models")
    return {"qwen3_vl_moe": save_tiny_qwen3_vl(root / "q3", TinyQwen3VLSpec(layers=2)), "qwen2_5_vl": save_tiny_vlm(root / "q25")}


def data_inputs(model, **overrides):
    from megarl.config import load_config
    from megarl.trainer import build

    cfg = load_config(None, [f"model.hf_path={model}", *[f"{k}={v}" for k, v in overrides.items()]])
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(str(model))
    return cfg, hf_config, tokenizer, build.image_inputs(cfg, hf_config, tokenizer)


def write_rows(tmp_path, rows):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def frames(tmp_path, name, n, h=32, w=48, seed=0):
    return [png(tmp_path / f"{name}{k}.png", h, w, seed + k).name for k in range(n)]


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen2_5_vl"])
def test_video_rows_expand_to_the_right_tokens_and_pixels(models, tmp_path, family):
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset

    cfg, hf_config, tok, inputs = data_inputs(models[family])
    rows = [{"id": "v", "problem": "Look: <video> and <image>!", "answer": "1", "images": [png(tmp_path / "i.png", 32, 32).name],
             "videos": [{"frames": frames(tmp_path, "f", 3), "fps": 2}]}]
    ds = tokenize_dataset(load_prompt_dataset(write_rows(tmp_path, rows)), tok, template="raw", max_prompt_len=400,
                          images=inputs)
    (item,) = ds.items
    ids = item.prompt_ids
    pix = inputs.pixels(item.images)
    # 3 frames of 32 x 48 (a multiple of 8: no resize) -> 2 temporal patches of 4 x 6 patches -> 6 tokens each
    assert pix.video_grid_thw.tolist() == [[2, 8, 12]] and pix.pixel_values_videos.shape == (2 * 8 * 12, 3 * 2 * 16)
    assert ids.count(hf_config.video_token_id) == 2 * 24 and ids.count(hf_config.image_token_id) == 16
    text = tok.decode(ids)
    if family == "qwen3_vl_moe":  # one run per temporal patch after its timestamp: frames at 0, 0.5, 1.0 s
        assert "Look: <0.2 seconds><|vision_start|><|video_pad|>" in text and "<1.0 seconds><|vision_start|>" in text
        assert text.count("<|vision_start|>") == 3
    else:  # one run; second_per_grid_ts = temporal patch / fps
        assert text.startswith("Look: <|vision_start|><|video_pad|>") and text.count("<|vision_start|>") == 2
        assert pix.second_per_grid_ts.tolist() == [1.0]
    # the engine's M-RoPE placement accepts what the data path produced
    from megarl.models.families import arch_spec
    from megarl.models.vision.mrope import vision_position_ids

    pos, _ = vision_position_ids(torch.tensor([ids]), arch_spec(hf_config).vision, pix.image_grid_thw,
                                 pix.video_grid_thw, pix.second_per_grid_ts)
    assert pos.shape == (3, 1, len(ids))
    # frames already at the target size: HF's fused (x - mean/r) / (std/r) of the raw pixels, in HF's patch order
    s = inputs.videos.settings
    raw = torch.stack([torch.from_numpy(np.asarray(Image.open(tmp_path / f"f{k}.png"), dtype=np.float32)).permute(2, 0, 1)
                       for k in (0, 1, 2, 2)])
    mean, std = torch.tensor(s.mean)[:, None, None] * 255, torch.tensor(s.std)[:, None, None] * 255
    ref = hf_function("qwen3_vl.video_processing_qwen3_vl", "patchify", "Qwen3VLVideoProcessor")(
        None, ((raw - mean) / std)[None], 4, 2, 2)[0][0]
    assert torch.allclose(pix.pixel_values_videos, ref, atol=1e-5)


def test_bad_and_over_budget_videos_are_skipped_by_name(models, tmp_path, caplog):
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset

    cfg, _, tok, inputs = data_inputs(models["qwen3_vl_moe"], **{"data.max_video_tokens": 60})
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut")
    ok = frames(tmp_path, "ok", 2)
    rows = [{"id": "good", "problem": "<video>?", "answer": "1", "videos": [ok]},
            {"id": "missing", "problem": "<video>?", "answer": "1", "videos": [ok + ["nowhere.png"]]},
            {"id": "corrupt", "problem": "<video>?", "answer": "1", "videos": [["broken.png"] + ok]},
            {"id": "sizes", "problem": "<video>?", "answer": "1", "videos": [ok + [png(tmp_path / "odd.png", 16, 16).name]]},
            {"id": "long", "problem": "<video>?", "answer": "1", "videos": [frames(tmp_path, "l", 8)]},  # 4 x 24 > 60
            {"id": "frames", "problem": "<video>?", "answer": "1", "videos": [ok * 9]},  # 18 > max_frames 16
            {"id": "marks", "problem": "<video> <video>?", "answer": "1", "videos": [ok]}]
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        ds = tokenize_dataset(load_prompt_dataset(write_rows(tmp_path, rows)), tok, template="raw", max_prompt_len=200,
                              images=inputs)
    assert [it.uid for it in ds.items] == ["good"]
    why = {r: reason for r, reason in ds.skipped}
    assert len(why) == 6
    assert "nowhere.png" in why[2] and "broken.png" in why[3] and "different sizes" in why[4]
    assert "96 tokens > data.max_video_tokens 60" in why[5] and "max_frames 16" in why[6]
    assert "2 '<video>' placeholders but the row has 1 video" in why[7]
    assert "unusable images" in caplog.text and "id 'long'" in caplog.text
    # the same rules in SFT rows
    from megarl.trainer.sft import load_sft_rows

    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps({"prompt": r["problem"], "response": "1", "videos": r["videos"]})
                             for r in rows) + "\n")
    trajs, skipped = load_sft_rows(str(sft), tok, 200, images=inputs, image_key="images")
    assert len(trajs) == 1 and len(skipped) == 6
    assert trajs[0].videos["video_grid_thw"].tolist() == [[1, 8, 12]] and trajs[0].pixel_values is None


def test_config_fields_reach_the_data_path(models, tmp_path):
    """data.video_key / video_placeholder / max_video_tokens through build.image_inputs + build_data."""
    from megarl.trainer import build

    rows = [{"id": "short", "problem": "See <clip>?", "answer": "1", "clips": [frames(tmp_path, "s", 2)]},
            {"id": "long", "problem": "See <clip>?", "answer": "1", "clips": [frames(tmp_path, "l", 6)]},
            {"id": "other_key", "problem": "See <clip>?", "answer": "1", "videos": [frames(tmp_path, "s", 2)]}]
    cfg, hf_config, tok, inputs = data_inputs(
        models["qwen3_vl_moe"], **{"data.train_path": write_rows(tmp_path, rows), "data.prompt_template": "raw",
                                   "data.video_key": "clips", "data.video_placeholder": "<clip>",
                                   "data.max_video_tokens": 50, "data.max_prompt_len": 120,
                                   "rollout.prompts_per_step": 1, "algorithm.mini_batch_size": 16})
    ds = build.build_data(cfg, tok, inputs).train.dataset
    by_id = {it.uid: it for it in ds}
    assert set(by_id) == {"short", "other_key"}  # "long": 3 x 24 tokens > 50
    assert by_id["short"].prompt_ids.count(hf_config.video_token_id) == 24
    assert tok.decode(by_id["short"].prompt_ids).startswith("See <0.2 seconds><|vision_start|>")
    assert by_id["other_key"].images is None and hf_config.video_token_id not in by_id["other_key"].prompt_ids
