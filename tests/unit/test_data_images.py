"""Images in prompt rows (megarl.data.images, megarl.data.dataset, megarl.trainer.sft): references,
placeholder expansion against HF's own processor, and rows with bad images skipped by name."""

import base64
import json
import logging

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
from megarl.data.images import ImageError, ImageInputs, image_refs, open_image
from megarl.tasks.tiny_model import build_byte_tokenizer
from megarl.trainer.sft import load_sft_rows

VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION})
    return tok


def processor():
    return transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 64)


@pytest.fixture(scope="module")
def inputs(tokenizer):
    start, pad, end = tokenizer.convert_tokens_to_ids(VISION)
    return ImageInputs(processor(), pad, start, end, tokenizer, max_image_tokens=40)


def png(path, h, w, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def test_token_counts_match_hf_processor_grids(inputs):
    # the count comes from the resize rule alone; HF's processor must produce exactly that grid
    for h, w in [(20, 37), (48, 40), (9, 9), (33, 18), (64, 64), (100, 17)]:
        img = Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))
        grid = processor()(images=[img], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert list(inputs.grid(h, w)) == grid, (h, w)
        assert inputs.n_tokens(img) == grid[0] * grid[1] * grid[2] // 4


def test_expand_and_markers(inputs, tokenizer):
    text = inputs.with_markers("<image>How many?<image>", 2)
    ids = tokenizer(text)["input_ids"]
    out = inputs.expand(ids, [3, 5])
    pad = inputs.image_token_id
    runs = [k for k in range(len(out)) if out[k] == pad]
    assert len(runs) == 8 and out.count(inputs.start_id) == 2 and out.count(inputs.end_id) == 2
    assert tokenizer.decode([t for t in out if t not in (pad, inputs.start_id, inputs.end_id)]) == "How many?"
    # no placeholder: the images go first; more placeholders than images is an error
    assert inputs.with_markers("Q", 1).endswith("Q") and inputs.with_markers("Q", 1).startswith(inputs.marker)
    with pytest.raises(ImageError, match="2 '<image>' placeholders but the row has 1"):
        inputs.with_markers("<image><image>", 1)
    with pytest.raises(ImageError, match="2 image pad tokens for 1"):
        inputs.expand(ids, [3])


def test_image_refs_forms(tmp_path):
    p = png(tmp_path / "a.png", 12, 16)
    raw = p.read_bytes()
    b64 = base64.b64encode(raw).decode()
    refs = image_refs(["a.png", f"data:image/png;base64,{b64}", {"bytes": raw, "path": "x.png"}, str(p)], tmp_path)
    assert [r.path is not None for r in refs] == [True, False, False, True]
    assert refs[0].path == str(tmp_path / "a.png")
    for r in refs:
        assert open_image(r).size == (16, 12)
    if len(b64) > 1024:
        assert image_refs(b64, tmp_path)[0].data == raw
    with pytest.raises(ImageError, match="not valid base64"):
        image_refs("data:image/png;base64,@@@", tmp_path)
    with pytest.raises(ImageError, match="expected a path"):
        image_refs([3], tmp_path)


def test_missing_corrupt_and_large_images_are_counted_skips(tmp_path, tokenizer, inputs, caplog):
    png(tmp_path / "ok.png", 20, 24, seed=1)
    png(tmp_path / "big.png", 64, 64, seed=2)  # 16 x 16 patches -> 64 tokens > max_image_tokens 40
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    rows = [
        {"id": "good", "problem": "<image>\nHow many red squares?", "answer": "3", "images": ["ok.png"]},
        {"id": "missing", "problem": "<image>\nQ", "answer": "1", "images": ["nowhere.png"]},
        {"id": "corrupt", "problem": "<image>\nQ", "answer": "1", "images": ["bad.png"]},
        {"id": "large", "problem": "<image>\nQ", "answer": "1", "images": ["big.png"]},
        {"id": "text", "problem": "2+2?", "answer": "4"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with caplog.at_level(logging.WARNING):
        ds = tokenize_dataset(load_prompt_dataset(path), tokenizer, template="raw", max_prompt_len=256, images=inputs)
    assert [it.uid for it in ds] == ["good", "text"]
    reasons = dict(ds.skipped)
    assert set(reasons) == {2, 3, 4}  # row numbers
    assert "'missing'" in reasons[2] and "nowhere.png" in reasons[2]
    assert "'corrupt'" in reasons[3] and "not a readable image" in reasons[3]
    assert "'large'" in reasons[4] and "64 tokens > data.max_image_tokens 40" in reasons[4]
    assert "skipped 3 row(s) with unusable images" in caplog.text and "nowhere.png" in caplog.text
    good = ds.items[0]
    n = inputs.n_tokens(Image.open(tmp_path / "ok.png"))
    # by hand: 20 x 24 px -> sides rounded to multiples of p*m = 8: 16 x 24 (round(2.5) = 2) -> 4 x 6
    # patches -> 24 / m^2 = 6 tokens
    assert n == 6 and good.prompt_ids.count(inputs.image_token_id) == 6
    pix = inputs.pixels(good.images)
    assert pix.image_grid_thw.prod(-1).sum().item() // 4 == good.prompt_ids.count(inputs.image_token_id)
    assert pix.pixel_values.shape == (int(pix.image_grid_thw.prod(-1).sum()), 3 * 2 * 4 * 4)
    # image tokens count towards max_prompt_len
    short = tokenize_dataset(load_prompt_dataset(path), tokenizer, template="raw", max_prompt_len=20, images=inputs)
    assert [it.uid for it in short] == ["text"] and short.too_long[0][0] == "good"


def test_sft_rows_with_images(tmp_path, tokenizer, inputs):
    png(tmp_path / "ok.png", 20, 24, seed=1)
    rows = [{"prompt": "<image>\nHow many?\n", "response": "Answer: 3", "images": ["ok.png"]},
            {"prompt": "<image>\nQ\n", "response": "Answer: 1", "images": ["gone.png"]}]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, skipped = load_sft_rows(str(path), tokenizer, 256, inputs)
    assert len(out) == 1 and skipped[0][0] == 2 and "gone.png" in skipped[0][1]
    t = out[0]
    assert t.prompt_ids.count(inputs.image_token_id) == int(t.image_grid_thw.prod(-1).sum()) // 4
    ref = processor()(images=[Image.open(tmp_path / "ok.png").convert("RGB")], return_tensors="pt")
    assert torch.equal(t.pixel_values, ref["pixel_values"].float())


def test_config_fields_reach_the_data_path(tmp_path):
    """data.image_key / image_placeholder / max_image_tokens through build.image_inputs + build_data,
    with a saved tiny Qwen2.5-VL (its tokenizer and image processor files)."""
    from megarl.config import load_config
    from megarl.tasks.tiny_vlm import save_tiny_vlm
    from megarl.trainer import build

    model = save_tiny_vlm(tmp_path / "model")
    png(tmp_path / "small.png", 32, 32, seed=3)  # 8 x 8 patches -> 16 tokens
    png(tmp_path / "large.png", 64, 64, seed=4)  # 16 x 16 patches -> 64 tokens
    rows = [{"id": "small", "problem": "Count: <img>?", "answer": "1", "pics": ["small.png"]},
            {"id": "large", "problem": "Count: <img>?", "answer": "1", "pics": ["large.png"]},
            {"id": "other_key", "problem": "Count: <img>?", "answer": "1", "images": ["small.png"]}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(None, [f"model.hf_path={model}", f"data.train_path={path}", "data.prompt_template=raw",
                             "data.image_key=pics", "data.image_placeholder=<img>", "data.max_image_tokens=20",
                             "data.max_prompt_len=64", "rollout.max_new_tokens=8",
                             "rollout.prompts_per_step=1", "algorithm.mini_batch_size=16"])
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(str(model))
    images = build.image_inputs(cfg, hf_config, tokenizer)
    ds = build.build_data(cfg, tokenizer, images).train.dataset
    by_id = {it.uid: it for it in ds}
    assert set(by_id) == {"small", "other_key"}  # "large": 64 tokens > 20
    small = by_id["small"]
    assert small.prompt_ids.count(hf_config.image_token_id) == 16 and small.images is not None
    text = tokenizer.decode(small.prompt_ids)
    assert text.startswith("Count: <|vision_start|>") and text.endswith("<|vision_end|>?")
    # a row whose images sit under another key is text: its "<img>" stays text, no image tokens
    assert by_id["other_key"].images is None and hf_config.image_token_id not in by_id["other_key"].prompt_ids
    assert build.image_inputs(cfg, *build.load_hf_config_and_tokenizer(str(model))).max_image_tokens == 20
