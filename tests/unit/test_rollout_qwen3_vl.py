"""Builtin rollout engine on Qwen3-VL-MoE and Qwen3-VL (megarl.rollout.torch_qwen3_vl) against HF
transformers 5.19's own models, and Qwen2.5-VL with videos (megarl.rollout.torch_vlm).

Tiny random checkpoints saved by transformers' `save_pretrained` (scripts_qwen3_vl_common: the MoE
file holds transformers 5's fused expert layout, which the engine reads through HFCheckpoint) and
one batch mixing a text-only prompt, a one-image and a two-image prompt, a video prompt and an image
+ video prompt (different lengths: left padding; n = 2). The engine's per-token log-probs (sampled
at temperature 1, and greedy) equal HF's log-probs of the same prompt + response (fp32, < 1e-5),
greedy decoding equals HF `generate`, the experts the engine records for every prompt and response
token (image and video tokens included) are the ones HF's routers pick, and the tower runs once
per prompt and modality."""

from __future__ import annotations

import pytest
import torch
import transformers

from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from tests.distributed.scripts_qwen3_vl_common import (
    VEND, hf_model, make_prompt, make_tiny_qwen3_vl, mm_types)

TOL = 1e-5
MAX_NEW = 6


def hf_kwargs(images, hf) -> dict:
    """The processor-style inputs HF's model of `hf` takes (second_per_grid_ts: Qwen2.5-VL only)."""
    return {k: v for k, v in (images or {}).items() if k != "second_per_grid_ts" or hf.config.model_type == "qwen2_5_vl"}


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "qwen3_vl"])
def setup(request, tmp_path_factory):
    moe = request.param == "qwen3_vl_moe"
    hf_dir = make_tiny_qwen3_vl(tmp_path_factory.mktemp(request.param) / "hf", seed=5, moe=moe)
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    made = [make_prompt([(20, 37)], seed=1), make_prompt([(48, 40), (9, 9)], seed=2), make_prompt(seed=3),
            make_prompt(video=(2, 4, 6), seed=4), make_prompt([(16, 16)], video=(3, 4, 4), seed=6)]
    return dict(engine=engine, hf=hf_model(hf_dir), hf_dir=hf_dir, moe=moe, prompts=[p for p, _ in made],
                images=[i for _, i in made])


@torch.no_grad()
def hf_logits(hf, ids: list[int], images, position_ids=None, prompt_len: int | None = None) -> torch.Tensor:
    """HF's logits of `ids`; placeholder ids after `prompt_len` (a response) are text."""
    t = torch.tensor([ids])
    types = mm_types(t)
    types[:, len(ids) if prompt_len is None else prompt_len:] = 0
    hf.model.rope_deltas = None
    return hf(input_ids=t, mm_token_type_ids=types, position_ids=position_ids, **hf_kwargs(images, hf)).logits[0]


def hf_logprobs(hf, sample, images, temperature: float = 1.0) -> torch.Tensor:
    logits = hf_logits(hf, sample.prompt_ids + sample.response_ids, images, prompt_len=len(sample.prompt_ids)).float()
    p = len(sample.prompt_ids)
    lp = torch.log_softmax(logits / temperature, -1)
    return lp[torch.arange(p - 1, p - 1 + len(sample.response_ids)), torch.tensor(sample.response_ids)]


def max_diff(hf, samples, images, temperature=1.0) -> float:
    return max(float((hf_logprobs(hf, s, images[s.index], temperature) - torch.tensor(s.logprobs)).abs().max())
               for s in samples)


def test_engine_holds_the_checkpoint_names(setup):
    from megarl.rollout.torch_vlm import hf_param_name
    from megarl.weights import HFCheckpoint

    engine = setup["engine"]
    ckpt = HFCheckpoint(setup["hf_dir"])
    assert set(engine.model.state_dict()) == {hf_param_name(n) for n in ckpt.names()}
    # the MoE file is in transformers 5's layout; the engine holds the released one
    assert ckpt.expert_layout == ("transformers5" if setup["moe"] else None)
    if setup["moe"]:
        assert tuple(engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape) == (6, 64, 48)
    assert engine.weights_ready


def test_sampled_logprobs_equal_hf(setup):
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    runs = []
    hook = engine.model.visual.register_forward_hook(lambda *a: runs.append(1))
    try:
        samples = engine.generate(setup["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW,
                                                                   seed=3), images=images)
    finally:
        hook.remove()
    assert len(runs) == 5  # once per prompt and modality: 3 image prompts, 2 video prompts, one of both
    assert len(samples) == 10 and all(len(s.response_ids) == MAX_NEW for s in samples)
    assert max_diff(hf, samples, images) < TOL


def test_greedy_equals_hf_generate_and_logprobs(setup):
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    greedy = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    for p, im, s in zip(setup["prompts"], images, greedy):
        ids = torch.tensor([p])
        hf.model.rope_deltas = None
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types(ids), do_sample=False,
                          max_new_tokens=MAX_NEW, pad_token_id=0, **hf_kwargs(im, hf))
        assert s.response_ids == out[0, len(p):].tolist()
    assert max_diff(hf, greedy, images) < TOL


def test_routing_of_every_token_is_hf_routers_choice(setup):
    """MoE: the experts recorded for each prompt token (text, image and video) and response token
    are the top-k HF's routers pick in a full forward of prompt + response (all but the last
    token, which the engine never forwards)."""
    if not setup["moe"]:
        pytest.skip("dense model")
    engine, hf, images = setup["engine"], setup["hf"], setup["images"]
    samples = engine.generate(setup["prompts"], SamplingParams(n=1, temperature=1.0, max_new_tokens=MAX_NEW, seed=9),
                              images=images)
    gates = [layer.mlp.gate for layer in hf.model.language_model.layers]
    for s in samples:
        picked = []
        hooks = [g.register_forward_hook(lambda m, a, out: picked.append(out[2].sort(-1).values)) for g in gates]
        try:
            hf_logits(hf, s.prompt_ids + s.response_ids, images[s.index], prompt_len=len(s.prompt_ids))
        finally:
            for h in hooks:
                h.remove()
        n = len(s.prompt_ids) + len(s.response_ids)
        assert s.routed_experts.shape == (n, 3, 2)
        assert torch.equal(s.routed_experts[: n - 1].long(), torch.stack(picked, 1)[: n - 1])


def test_deepstack_and_interleaved_mrope_matter(setup):
    """Teeth: HF's log-probs of the engine's greedy samples move far beyond TOL without DeepStack
    or with Qwen2.5-VL's contiguous M-RoPE sections, so the comparisons above see both."""
    engine, images = setup["engine"], setup["images"]
    s = engine.generate(setup["prompts"][4:5], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                        images=images[4:5])[0]
    ref = torch.tensor(s.logprobs)
    hf = hf_model(setup["hf_dir"])
    hf.model.visual.deepstack_visual_indexes = []
    assert float((hf_logprobs(hf, s, images[4]) - ref).abs().max()) > 1e-3
    hf = hf_model(setup["hf_dir"])
    rotary = hf.model.language_model.rotary_emb

    def contiguous(freq):
        f = torch.cat([part[i % 3] for i, part in enumerate(freq.split(list(rotary.mrope_section), dim=-1))], -1)
        return torch.cat([f, f], dim=-1)

    rotary.recomposition_frequencies = contiguous
    assert float((hf_logprobs(hf, s, images[4]) - ref).abs().max()) > 1e-3


def test_continue_truncated_samples_with_images_and_video(setup):
    engine, images = setup["engine"], setup["images"]
    full = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    part = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, window=2),
                           images=images)
    cont = engine.continue_samples(part, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    assert [s.response_ids for s in cont] == [s.response_ids for s in full]


def test_bad_video_inputs_fail_clearly(setup):
    engine, prompts, images = setup["engine"], setup["prompts"], setup["images"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="video placeholder tokens .* but no videos"):
        engine.generate(prompts[3:4], greedy, images=[None])
    with pytest.raises(ValueError, match="lack.*video_grid_thw"):
        engine.generate(prompts[3:4], greedy, images=[{"pixel_values_videos": images[3]["pixel_values_videos"]}])
    with pytest.raises(ValueError, match="video placeholder tokens but the videos give"):
        engine.generate(prompts[3:4], greedy, images=[dict(images[3], video_grid_thw=torch.tensor([[2, 4, 4]]),
                                                           pixel_values_videos=images[3]["pixel_values_videos"][:32])])


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    from tests.distributed.scripts_vlm_common import make_tiny_vlm

    hf_dir = make_tiny_vlm(tmp_path_factory.mktemp("q25") / "hf", seed=1)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return BuiltinEngine.from_pretrained(hf_dir, tokenizer=None), hf


def test_qwen2_5_vl_video_equals_hf(qwen25):
    """Qwen2.5-VL videos: one run per video, temporal ids stepped by tokens_per_second (4) x
    second_per_grid_ts; videos whose temporal span fits their spatial one (HF 5.19 and Qwen's
    original placement agree there, megarl.models.vision.mrope)."""
    engine, hf = qwen25
    made = [make_prompt(video=(2, 6, 8), seed=4, frame_runs=False), make_prompt(video=(3, 8, 8), seed=5, frame_runs=False),
            make_prompt([(20, 37)], video=(2, 8, 8), seed=6, frame_runs=False)]
    for (_, im), sec in zip(made, (0.5, 0.25, 0.5)):
        im["second_per_grid_ts"] = torch.tensor([sec])
    prompts, images = [p for p, _ in made], [i for _, i in made]
    samples = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=2),
                              images=images)
    assert max_diff(hf, samples, images) < TOL
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    for p, im, s in zip(prompts, images, greedy):
        ids = torch.tensor([p])
        hf.model.rope_deltas = None
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types(ids), do_sample=False,
                          max_new_tokens=MAX_NEW, pad_token_id=0, **im)
        assert s.response_ids == out[0, len(p):].tolist()
    # teeth: another frame spacing moves HF's log-probs of the same samples
    slow = [dict(im, second_per_grid_ts=im["second_per_grid_ts"] * 2) for im in images]
    assert max_diff(hf, samples, slow) > 1e-3


def test_qwen2_5_vl_long_video_follows_the_original_placement(qwen25):
    """A video whose temporal ids reach past its spatial ones: the text after it starts after the
    largest temporal id (Qwen's original get_rope_index, SGLang, HF's own decode steps); the
    engine's log-probs equal HF's model given those positions."""
    from megarl.models.vision.mrope import vision_position_ids

    engine, hf = qwen25
    ids, im = make_prompt(video=(3, 4, 6), seed=4, frame_runs=False)  # temporal 0, 4, 8; spatial 2 x 3
    s = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=[im])[0]
    full = torch.tensor([s.prompt_ids + s.response_ids])
    v = engine.args.vision
    pos, _ = vision_position_ids(full, v, None, im["video_grid_thw"], im["second_per_grid_ts"])
    after = s.prompt_ids.index(VEND)  # the first token after the video run
    assert int(pos[0, 0, after]) == int(pos[0, 0, :after].max()) + 1 == 4 + 8 + 1
    p = len(s.prompt_ids)
    logits = hf_logits(hf, s.prompt_ids + s.response_ids, im, position_ids=pos, prompt_len=p).float()
    lp = torch.log_softmax(logits, -1)[torch.arange(p - 1, p - 1 + MAX_NEW), torch.tensor(s.response_ids)]
    assert float((lp - torch.tensor(s.logprobs)).abs().max()) < TOL
