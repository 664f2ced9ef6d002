"""The tiny Qwen2.5-VL maker (megarl.tasks.tiny_vlm): the saved directory loads with HF's Auto
classes, its vision token ids are the tokenizer's, a task image becomes 36 image tokens, HF's model
runs on the processed prompt, and megarl's model family / builtin engine accept the checkpoint
(the engine's log-probs equal HF's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from megarl.rollout.types import SamplingParams
from megarl.tasks.tiny_vlm import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, TinyVLMSpec, expand_image_markers,
                                   save_tiny_vlm)

PROMPT = "<image>\nHow many red squares?\n"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "hf", seed=1)


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))


def processed(hf_dir, image, text=PROMPT):
    """(input ids [1, s], pixel inputs) the way Qwen2_5_VLProcessor builds them: image processor
    pixels, and the image pad repeated grid t*h*w / merge^2 times."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    proc = transformers.AutoImageProcessor.from_pretrained(hf_dir)
    px = proc(images=[image], return_tensors="pt")
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids = tok(expand_image_markers(text), add_special_tokens=False)["input_ids"]
    n = int(px["image_grid_thw"].prod()) // proc.merge_size**2
    k = ids.index(pad)
    return torch.tensor([ids[:k] + [pad] * n + ids[k + 1:]]), dict(px)


def test_auto_classes_load_and_ids_agree(hf_dir):
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    proc = transformers.AutoImageProcessor.from_pretrained(hf_dir)
    assert cfg.model_type == "qwen2_5_vl"
    assert type(proc).__name__.startswith("Qwen2VLImageProcessor")  # ...Pil without torchvision
    ids = [259, 260, 261, 262]
    assert [tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)] == ids
    assert [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id] == ids
    assert len(tok) == 263 and cfg.text_config.vocab_size == 320
    assert tok.eos_token_id == tok.pad_token_id == cfg.text_config.eos_token_id == 256
    text = "Answer: 3\n"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(tok(text)["input_ids"]) == text
    t, v = cfg.text_config, cfg.vision_config
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads) == (3, 128, 4, 2)
    assert sum(t.rope_parameters["mrope_section"]) == t.hidden_size // t.num_attention_heads // 2
    assert (v.depth, v.hidden_size, v.patch_size, v.spatial_merge_size, v.out_hidden_size) == (2, 64, 4, 2, 128)
    assert json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"] == 256


def test_auto_processor_expands_the_image_pad(hf_dir, image):
    """Needs torchvision (transformers 5.19's Qwen2_5_VLProcessor insists on a video processor)."""
    pytest.importorskip("torchvision")
    proc = transformers.AutoProcessor.from_pretrained(hf_dir)
    out = proc(images=[image], text=[expand_image_markers(PROMPT)], return_tensors="pt")
    ids, _ = processed(hf_dir, image)
    assert out["input_ids"].tolist() == ids.tolist() and int((out["input_ids"] == 261).sum()) == 36


def test_hf_model_runs_on_a_processed_prompt(hf_dir, image):
    ids, px = processed(hf_dir, image)
    assert px["image_grid_thw"].tolist() == [[1, 12, 12]] and int((ids == 261).sum()) == 36
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == 261).int(), **px).logits
    assert logits.shape == (1, ids.shape[1], 320) and torch.isfinite(logits).all()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == 261).int(),
                         max_new_tokens=4, do_sample=False, **px)
    assert out.shape == (1, ids.shape[1] + 4)


def test_megarl_family_and_builtin_engine_accept_it(hf_dir, image):
    from megarl.models.bridge import expected_hf_shapes
    from megarl.models.families import arch_spec
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.torch_vlm import qwen2_5_vl_args
    from safetensors import safe_open

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    spec = arch_spec(cfg)
    assert spec.mrope_section == (4, 6, 6) and spec.vision.image_token_id == 261
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert expected_hf_shapes(spec) == shapes
    assert qwen2_5_vl_args(json.loads((hf_dir / "config.json").read_text())).vision.window_size == 64

    ids, px = processed(hf_dir, image)
    engine = BuiltinEngine.from_pretrained(hf_dir)
    sample = engine.generate([ids[0].tolist()], SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=2),
                             images=[px])[0]
    full = torch.tensor([sample.prompt_ids + sample.response_ids])
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=full, mm_token_type_ids=(full == 261).int(), **px).logits[0]
    p = len(sample.prompt_ids)
    hf_lp = torch.log_softmax(logits, -1)[torch.arange(p - 1, full.shape[1] - 1), torch.tensor(sample.response_ids)]
    assert float((hf_lp - torch.tensor(sample.logprobs)).abs().max()) < 1e-5


def test_spec_is_checked():
    from megarl.tasks.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config

    with pytest.raises(ValueError, match="mrope_section"):
        tiny_vlm_config(build_vlm_tokenizer(), TinyVLMSpec(mrope_section=(4, 4, 4)))
    with pytest.raises(ValueError, match="kv_heads"):
        tiny_vlm_config(build_vlm_tokenizer(), TinyVLMSpec(kv_heads=3))
