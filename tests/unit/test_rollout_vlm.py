"""Builtin rollout engine on Qwen2.5-VL (megarl.rollout.torch_vlm): prompts with images.

A tiny random qwen2_5_vl checkpoint (tests/distributed/scripts_vlm_common.py) and real RGB images
through HF's image processor. The engine's per-token log-probs (sampled at temperature 1 and 0.7,
and greedy) equal HF transformers' `Qwen2_5_VLForConditionalGeneration` log-probs of the same
prompt + response (fp32, < 1e-5); greedy generation equals HF `generate`; the batch mixes one-
and two-image prompts of different lengths with a text-only prompt (left padding, n > 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import PromptImages, SamplingParams
from tests.distributed.scripts_vlm_common import IMAGE, VEND, VSTART, make_prompt, make_tiny_vlm

TOL = 1e-5
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf_dir = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "hf", seed=5)
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    made = [make_prompt([(20, 37)], 1), make_prompt([(48, 40), (9, 9)], 2), make_prompt([], 3)]
    return dict(engine=engine, hf=hf, hf_dir=hf_dir, prompts=[p for p, _ in made], images=[i for _, i in made])


def hf_kwargs(images):
    return {} if images is None else dict(pixel_values=images["pixel_values"], image_grid_thw=images["image_grid_thw"])


@torch.no_grad()
def hf_logprobs(hf, sample, images, temperature: float = 1.0, position_ids=None) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    assert not (set(sample.response_ids) & {IMAGE, VSTART, VEND})  # placeholders only in the prompt
    hf.model.rope_deltas = None
    logits = hf(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), position_ids=position_ids,
                **hf_kwargs(images)).logits[0].float()
    p = len(sample.prompt_ids)
    lp = torch.log_softmax(logits / temperature, -1)
    return lp[torch.arange(p - 1, p - 1 + len(sample.response_ids)), torch.tensor(sample.response_ids)]


def max_diff(hf, samples, images, temperature=1.0) -> float:
    return max(float((hf_logprobs(hf, s, images[s.index], temperature) - torch.tensor(s.logprobs)).abs().max())
               for s in samples)


def test_engine_builds_the_vision_model_with_hf_names(setup):
    from safetensors import safe_open

    engine = setup["engine"]
    with safe_open(str(setup["hf_dir"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert set(engine.model.state_dict()) == names
    assert sum(n.startswith("visual.") for n in names) == 30
    assert engine.weights_ready and engine.weight_version == 1
    assert [m for m in setup["prompts"][:2] if IMAGE in m] and IMAGE not in setup["prompts"][2]


def test_sampled_logprobs_equal_hf(setup):
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    runs = []
    hook = engine.model.visual.register_forward_hook(lambda *a: runs.append(1))
    try:
        samples = engine.generate(setup["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW,
                                                                   seed=3), images=images)
    finally:
        hook.remove()
    assert len(runs) == 2  # the tower runs once per prompt with images (n=2 samples share the prefill)
    assert len(samples) == 6 and all(len(s.response_ids) == MAX_NEW for s in samples)
    assert samples[0].images is not None and samples[4].images is None
    assert max_diff(hf, samples, images) < TOL


def test_tempered_sampling_logprobs_equal_hf(setup):
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    samples = engine.generate(setup["prompts"], SamplingParams(n=2, temperature=0.7, max_new_tokens=MAX_NEW, seed=12),
                              images=images)
    assert max_diff(hf, samples, images, temperature=0.7) < TOL


def test_greedy_equals_hf_generate_and_logprobs(setup):
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    greedy = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    for p, im, s in zip(setup["prompts"], images, greedy):
        ids = torch.tensor([p])
        hf.model.rope_deltas = None
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE).int(),
                          do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, **hf_kwargs(im))
        assert s.response_ids == out[0, len(p):].tolist()
    assert max_diff(hf, greedy, images) < TOL
    # a single prompt alone (no padding) decodes the same
    alone = engine.generate(setup["prompts"][1:2], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                            images=[PromptImages(**images[1])])
    assert alone[0].response_ids == greedy[1].response_ids


def test_m_rope_and_images_matter(setup):
    """Teeth: HF's log-probs of the engine's samples move far beyond TOL with 1-D positions or with
    other pixels, so the comparisons above see both."""
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    s = engine.generate(setup["prompts"][1:2], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                        images=images[1:2])[0]
    n = len(s.prompt_ids) + len(s.response_ids)
    rope_1d = hf_logprobs(hf, s, images[1], position_ids=torch.arange(n)[None])
    other = dict(images[1], pixel_values=images[1]["pixel_values"].flip(0))
    flipped = hf_logprobs(hf, s, other)
    ref = torch.tensor(s.logprobs)
    assert float((rope_1d - ref).abs().max()) > 1e-3
    assert float((flipped - ref).abs().max()) > 1e-3


def test_continue_truncated_samples_with_images(setup):
    engine, images = setup["engine"], setup["images"]
    full = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    part = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, window=2),
                           images=images)
    assert all(s.finish_reason == "truncated" for s in part)
    cont = engine.continue_samples(part, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    assert [s.response_ids for s in cont] == [s.response_ids for s in full]
    for a, b in zip(cont, full):
        assert np.allclose(a.logprobs, b.logprobs, atol=TOL)


def test_bad_image_inputs_fail_clearly(setup):
    engine, prompts, images = setup["engine"], setup["prompts"], setup["images"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="no images"):
        engine.generate(prompts[:1], greedy)
    with pytest.raises(ValueError, match="one entry"):
        engine.generate(prompts[:2], greedy, images=images[:1])
    with pytest.raises(ValueError, match="image placeholder tokens but the images give"):
        engine.generate(prompts[:1], greedy, images=images[1:2])  # 2 images for a 1-image prompt
    with pytest.raises(ValueError, match="patch rows"):
        bad = dict(images[0], pixel_values=images[0]["pixel_values"][:-4])
        engine.generate(prompts[:1], greedy, images=[bad])
    with pytest.raises(ValueError, match="image_grid_thw"):
        engine.generate(prompts[:1], greedy, images=[{"pixel_values": images[0]["pixel_values"]}])


def test_text_only_engine_refuses_images():
    engine = BuiltinEngine(transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1))
    with pytest.raises(ValueError, match="no vision tower"):
        engine._check_images([{"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.ones(1, 3)}], 1)
    assert engine._check_images(None, 2) is None


def test_transformers5_module_names_and_legacy_config_load(setup):
    """The engine loads HF's in-memory names (`model.language_model.*`, `model.visual.*`) and reads a
    transformers-4 style config.json (LM fields at the top level, rope_scaling type "mrope")."""
    import json

    from megarl.rollout.torch_model import model_args_from_hf_config

    engine, hf = setup["engine"], setup["hf"]
    state = hf.state_dict()
    assert any(n.startswith("model.language_model.") for n in state)
    assert any(n.startswith("model.visual.") for n in state)
    fresh = BuiltinEngine(json.loads((setup["hf_dir"] / "config.json").read_text()))
    fresh.update_weights([list(state.items())])  # strict: every parameter found by name
    p, im = setup["prompts"][0], setup["images"][0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    assert fresh.generate([p], greedy, images=[im])[0].logprobs == engine.generate([p], greedy, images=[im])[0].logprobs

    cfg = json.loads((setup["hf_dir"] / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    legacy = {**cfg, **{k: v for k, v in text.items() if k != "model_type"}, "rope_theta": rope["rope_theta"],
              "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert model_args_from_hf_config(legacy) == engine.args
