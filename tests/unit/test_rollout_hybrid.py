"""Builtin rollout engine on Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (megarl.rollout.torch_hybrid) against
HF transformers 5.19's own models: per-token log-probs of sampled and greedy samples (prompts of
different lengths: left padding; n = 2: repeated cache rows) within 1e-5, greedy decoding equal to
HF `generate`, the experts recorded for every token equal to HF's routers', text / one-image /
two-image / video prompts, and a cache whose delta-net part does not grow with the length.
Log-probs: within 1e-4 (issue 43's bound; observed up to 1.6e-5: the delta rule passes on the
rounding differences of the left-padded batch, where the Qwen3-VL engine tests hold 1e-5)."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.torch_hybrid import HybridCache
from megarl.rollout.types import SamplingParams
from tests.distributed.scripts_hybrid import hf_class, make_tiny, tiny_config
from tests.distributed.scripts_qwen3_vl_common import make_prompt, mm_types

TOL = 1e-4
MAX_NEW = 6


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def setup(request, tmp_path_factory):
    family = request.param
    hf_dir = make_tiny(family, tmp_path_factory.mktemp(family) / "hf", seed=5)
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    hf = hf_class(family).from_pretrained(hf_dir, dtype=torch.float32).eval()
    if family == "qwen3_next":
        made = [make_prompt(seed=s) for s in (1, 2, 3)]
        made[1] = (made[1][0][:5], None)  # 5 tokens: prefilled with the 7-token ones, left-padded by 2
    else:
        made = [make_prompt([(20, 37)], seed=1), make_prompt([(48, 40), (9, 9)], seed=2), make_prompt(seed=3),
                make_prompt(video=(2, 4, 6), seed=4)]
    return dict(engine=engine, hf=hf, family=family, prompts=[p for p, _ in made],
                images=None if family == "qwen3_next" else [i for _, i in made])


@torch.no_grad()
def hf_logprobs(setup, sample, temperature: float = 1.0) -> torch.Tensor:
    hf, ids = setup["hf"], torch.tensor([sample.prompt_ids + sample.response_ids])
    if setup["images"] is None:
        logits = hf(input_ids=ids).logits[0]
    else:
        types = mm_types(ids)
        types[:, len(sample.prompt_ids):] = 0  # placeholder ids in a response are text
        hf.model.rope_deltas = None
        extra = {k: v for k, v in (setup["images"][sample.index] or {}).items() if k != "second_per_grid_ts"}
        logits = hf(input_ids=ids, mm_token_type_ids=types, **extra).logits[0]
    p = len(sample.prompt_ids)
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp[torch.arange(p - 1, p - 1 + len(sample.response_ids)), torch.tensor(sample.response_ids)]


def max_diff(setup, samples) -> float:
    return max(float((hf_logprobs(setup, s) - torch.tensor(s.logprobs)).abs().max()) for s in samples)


def test_sampled_and_greedy_logprobs_equal_hf(setup):
    engine = setup["engine"]
    samples = engine.generate(setup["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3),
                              images=setup["images"])
    assert len(samples) == 2 * len(setup["prompts"]) and all(len(s.response_ids) == MAX_NEW for s in samples)
    assert max_diff(setup, samples) < TOL
    greedy = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                             images=setup["images"])
    assert max_diff(setup, greedy) < TOL


def test_greedy_equals_hf_generate(setup):
    engine, hf = setup["engine"], setup["hf"]
    greedy = engine.generate(setup["prompts"], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                             images=setup["images"])
    for i, (p, s) in enumerate(zip(setup["prompts"], greedy)):
        ids = torch.tensor([p])
        extra = {}
        if setup["images"] is not None:
            hf.model.rope_deltas = None
            extra = {k: v for k, v in (setup["images"][i] or {}).items() if k != "second_per_grid_ts"}
            extra["mm_token_type_ids"] = mm_types(ids)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          pad_token_id=0, **extra)
        assert s.response_ids == out[0, len(p):].tolist(), (i, s.response_ids)


def test_routing_of_every_token_is_hf_routers_choice(setup):
    if setup["family"] == "qwen3_5":
        pytest.skip("dense model")
    engine, hf = setup["engine"], setup["hf"]
    samples = engine.generate(setup["prompts"], SamplingParams(n=1, temperature=1.0, max_new_tokens=MAX_NEW, seed=9),
                              images=setup["images"])
    layers = hf.model.layers if setup["family"] == "qwen3_next" else hf.model.language_model.layers
    for s in samples:
        picked = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: picked.append(out[2].sort(-1).values))
                 for layer in layers]
        try:
            hf_logprobs(setup, s)
        finally:
            for h in hooks:
                h.remove()
        n = len(s.prompt_ids) + len(s.response_ids)
        assert s.routed_experts.shape == (n, 4, 2)
        assert torch.equal(s.routed_experts[: n - 1].long(), torch.stack(picked, 1)[: n - 1])


def test_continue_truncated_samples(setup):
    """Re-prefilling prompt + response rebuilds the recurrent states: the continued samples equal the
    uninterrupted ones. Prompts whose greedy response holds an image / video placeholder id are left
    out: re-prefilling such a response fails in torch_vlm for every vision family (Qwen3-VL too), a
    limitation this test does not cover."""
    engine, prompts, images = setup["engine"], setup["prompts"], setup["images"]
    full = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), images=images)
    keep = [i for i, s in enumerate(full) if not set(s.response_ids) & {150, 151}]
    assert len(keep) >= 2
    prompts, full = [prompts[i] for i in keep], [full[i] for i in keep]
    images = None if images is None else [images[i] for i in keep]
    part = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, window=2), images=images)
    assert all(s.finish_reason == "truncated" for s in part)
    cont = engine.continue_samples(part, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    assert [s.response_ids for s in cont] == [s.response_ids for s in full]


def test_the_recurrent_state_does_not_grow_with_the_length(setup):
    """Per delta-net layer the cache holds [rows, conv_dim, K-1] and [rows, n_v, d_k, d_v] (float32)
    at any length; only the one attention layer's K / V grow (kv_cache_bytes: that formula)."""
    engine = setup["engine"]
    args, g = engine.args, engine.args.variant.gdn
    short = HybridCache.allocate(args, 3, 16, torch.float32, torch.device("cpu"))
    long = HybridCache.allocate(args, 3, 1024, torch.float32, torch.device("cpu"))
    for i in g.linear_layers:
        assert short.keys[i].shape == long.keys[i].shape == (3, g.conv_dim, g.conv_kernel - 1)
        assert short.values[i].shape == long.values[i].shape == (3, g.num_value_heads, g.key_head_dim, g.value_head_dim)
        assert long.values[i].dtype == torch.float32
    assert long.keys[3].shape == (3, args.num_kv_heads, 1024, args.head_dim)
    from megarl.rollout.torch_model import kv_cache_bytes

    growth = kv_cache_bytes(args, 3, 1024, torch.float32) - kv_cache_bytes(args, 3, 16, torch.float32)
    assert growth == 1 * 2 * 3 * (1024 - 16) * args.num_kv_heads * args.head_dim * 4  # one attention layer
    assert kv_cache_bytes(args, 3, 16, torch.float32) == sum(t.numel() * t.element_size()
                                                             for t in (*short.keys, *short.values))


def test_configs_are_read_from_config_json(setup):
    cfg = tiny_config(setup["family"]).to_dict()
    from megarl.rollout.torch_model import model_args_from_hf_config

    args = model_args_from_hf_config(cfg)
    assert args.variant.rotary_dim == args.head_dim // 4 and args.variant.gdn.linear_layers == (0, 1, 2)
    if setup["family"] != "qwen3_next":
        bad = dict(cfg, text_config=dict(cfg["text_config"], rope_parameters=dict(
            cfg["text_config"]["rope_parameters"], mrope_section=[4, 2, 2])))
        with pytest.raises(ValueError, match="mrope_section"):
            model_args_from_hf_config(bad)
