"""Builtin rollout engine vs HF transformers on tiny random models (fp32, CPU).

References: HF `generate(do_sample=False)` per prompt (no padding) for greedy tokens, and the HF
forward log-softmax for the engine's per-token log-probs.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from megarl.rollout import BuiltinEngine, RolloutEngine, SamplingParams, make_engine

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# initializer_range 0.1 makes attention peaked enough that RoPE / masking mistakes change tokens.
COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
              initializer_range=0.1, eos_token_id=None)
FAMILIES = {
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
    "llama3_untied": lambda: LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE),
    "llama3_tied": lambda: LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
}
PROMPTS = [[5, 17, 33, 2, 99, 140], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [150, 3]]


def _hf_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    refs = [_hf_greedy(model, p, 12, None) for p in PROMPTS]  # HF generate, once per family
    return request.param, model, path, refs


def _hf_greedy(model, prompt: list[int], new_tokens: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def _hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = logits[len(prompt) - 1:-1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_greedy_matches_hf_generate(family_model):
    family, model, path, refs = family_model
    engine = BuiltinEngine.from_pretrained(path)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    assert [s.index for s in samples] == [0, 1, 2, 3]
    for prompt, sample, ref in zip(PROMPTS, samples, refs):
        assert sample.prompt_ids == prompt
        assert sample.response_ids == ref, family
        assert sample.finish_reason == "length"
        hf = _hf_logprobs(model, prompt, sample.response_ids)  # greedy: log-softmax at T=1
        torch.testing.assert_close(torch.tensor(sample.logprobs), hf, atol=1e-4, rtol=0)


def test_greedy_with_eos_removes_finished_rows(family_model):
    """Rows stop at different steps on EOS (the batch is compacted); each output is the HF
    greedy sequence cut after its first EOS."""
    family, model, path, refs = family_model
    engine = BuiltinEngine.from_pretrained(path)
    eos = refs[0][3]  # a token row 0 emits at step 3 -> it stops early
    engine.eos_token_ids = [eos]
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    assert samples[0].finish_reason == "stop" and len(samples[0].response_ids) <= 4
    for sample, ref in zip(samples, refs):
        expected = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert sample.response_ids == expected, family
        assert sample.finish_reason == ("stop" if eos in ref else "length")


def test_sampled_logprobs_match_hf_forward(family_model):
    family, model, path, _ = family_model
    engine = BuiltinEngine.from_pretrained(path)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, n=3,
                                                      seed=123))
    assert [s.index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1  # n samples differ
    for sample in samples:
        hf = _hf_logprobs(model, sample.prompt_ids, sample.response_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), hf, atol=1e-4, rtol=0)


def test_rope_scaling_is_applied(tmp_path):
    """The same weights without llama3 scaling give different tokens (the test above can fail)."""
    model = _hf_model("llama3_untied")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    theta = model.config.rope_parameters["rope_theta"]
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    plain = BuiltinEngine(config)
    plain.update_weights([list(model.state_dict().items())])
    scaled = BuiltinEngine.from_pretrained(tmp_path)
    prompt = [list(range(1, 60))]
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    assert plain.generate(prompt, sp)[0].response_ids != scaled.generate(prompt, sp)[0].response_ids


def _random_buckets(state: dict[str, torch.Tensor], seed: int) -> list[list]:
    rng = random.Random(seed)
    items = list(state.items())
    rng.shuffle(items)
    buckets, i = [], 0
    while i < len(items):
        size = rng.randint(1, 5)
        buckets.append(items[i:i + size])
        i += size
    return buckets


@pytest.mark.parametrize("family", ["qwen2", "llama3_tied"])
def test_update_weights_stream_equals_from_pretrained(family, tmp_path):
    model = _hf_model(family)
    model.save_pretrained(tmp_path)
    reference = BuiltinEngine.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    streamed = BuiltinEngine(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    streamed.update_weights(iter(_random_buckets(state, seed=7)))
    for sp in (SamplingParams(temperature=0, max_new_tokens=10),
               SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, n=2, seed=5)):
        a, b = reference.generate(PROMPTS, sp), streamed.generate(PROMPTS, sp)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert [s.logprobs for s in a] == [s.logprobs for s in b]


def test_update_weights_changes_outputs_and_version(tmp_path):
    m0, m1 = _hf_model("qwen2", seed=0), _hf_model("qwen2", seed=1)
    m0.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(PROMPTS, sp)
    engine.update_weights([list(m1.state_dict().items())])
    after = engine.generate(PROMPTS, sp)
    assert [s.response_ids for s in after] == [_hf_greedy(m1, p, 8, None) for p in PROMPTS]
    assert before[0].meta["weight_versions"] == [1] and after[0].meta["weight_versions"] == [2]


def test_sharded_checkpoint(tmp_path):
    model = _hf_model("qwen3")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = make_engine("builtin", model_path=tmp_path)
    assert isinstance(engine, BuiltinEngine) and isinstance(engine, RolloutEngine)
    sample = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8))[0]
    assert sample.response_ids == _hf_greedy(model, PROMPTS[0], 8, None)


def test_continue_samples_equals_direct_generation(tmp_path):
    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    direct = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=14))
    windowed = SamplingParams(temperature=0, max_new_tokens=14, window=4)
    samples = engine.generate(PROMPTS, windowed)
    assert all(s.finish_reason == "truncated" and len(s.response_ids) == 4 for s in samples)
    segments = 1
    while any(s.finish_reason == "truncated" for s in samples):
        samples = engine.continue_samples(samples, windowed)
        segments += 1
        assert all(len(s.response_ids) <= 14 for s in samples)
    assert segments == 4  # 4 + 4 + 4 + 2 tokens
    for d, s in zip(direct, samples):
        assert s.response_ids == d.response_ids
        assert s.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(d.logprobs),
                                   atol=1e-5, rtol=0)
        assert s.meta["weight_versions"] == [1, 1, 1, 1]


def test_bad_inputs_raise_clear_errors(tmp_path):
    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], sp)
    with pytest.raises(ValueError, match="prompt 0 has 96 tokens"):
        engine.generate([[1] * 96], sp)
    with pytest.raises(ValueError, match=r"prompt 2: token 160 at position 1 is outside"):
        engine.generate([[1], [2], [3, 160]], sp)
    with pytest.raises(ValueError, match=r"prompt 0: token -1"):
        engine.generate([[-1]], sp)
    with pytest.raises(ValueError, match="prompt 0: expected a list of token ids"):
        engine.generate(["hello"], sp)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(n=0), dict(max_new_tokens=0),
                dict(window=0), dict(top_k=2.5), dict(stop=[""]), dict(stop_token_ids=[-3]),
                dict(fire_top_k=0)):
        with pytest.raises(ValueError, match="SamplingParams"):
            engine.generate([[1, 2]], SamplingParams(**bad))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate([[1, 2]], SamplingParams(stop=["ab"]))
    done = engine.generate([[1, 2]], sp)
    with pytest.raises(ValueError, match="sample 0 has finish_reason 'length'"):
        engine.continue_samples(done, sp)
    # prompt + max_new_tokens beyond the context: generation stops at the context with "length"
    near = engine.generate([[1] * 94], SamplingParams(temperature=0, max_new_tokens=10))[0]
    assert len(near.response_ids) == 2 and near.finish_reason == "length"
    assert engine.generate([], sp) == []


def test_bad_weights_raise(tmp_path):
    model = _hf_model("qwen2")
    config = model.config.to_dict()
    engine = BuiltinEngine(config)
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate([[1]], SamplingParams())
    state = model.state_dict()
    with pytest.raises(ValueError, match="unknown weight 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([[("model.layers.9.mlp.up_proj.weight", torch.zeros(1))]])
    with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
        engine.update_weights([[("lm_head.weight", torch.zeros(3, 3))]])
    partial = [(k, v) for k, v in state.items() if k != "model.norm.weight"]
    with pytest.raises(ValueError, match=r"1 weights missing from the stream, e.g. \['model.norm"):
        engine.update_weights([partial])
    engine.update_weights([list(state.items())])
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    broken = [list(state.items())[:3], [("model.bogus.weight", torch.zeros(1))]]
    with pytest.raises(ValueError, match="unknown weight 'model.bogus.weight'"):
        engine.update_weights(iter(broken))
    with pytest.raises(RuntimeError, match="no complete weights"):  # half-updated: refuse
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        BuiltinEngine({"model_type": "gpt2"})


def test_release_and_resume_memory(tmp_path):
    model = _hf_model("llama3_tied")
    model.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    expected = [s.response_ids for s in engine.generate(PROMPTS, sp)]
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, sp)
    engine.resume_memory()
    assert [s.response_ids for s in engine.generate(PROMPTS, sp)] == expected
    engine.release_memory(discard_weights=True)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.update_weights([list(model.state_dict().items())])
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(PROMPTS, sp)
    engine.update_weights([list(model.state_dict().items())])
    assert [s.response_ids for s in engine.generate(PROMPTS, sp)] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_matches_cpu(tmp_path):
    model = _hf_model("qwen3")
    model.save_pretrained(tmp_path)
    cpu = BuiltinEngine.from_pretrained(tmp_path)
    gpu = BuiltinEngine.from_pretrained(tmp_path, device="cuda")
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    assert ([s.response_ids for s in cpu.generate(PROMPTS, sp)]
            == [s.response_ids for s in gpu.generate(PROMPTS, sp)])
    gpu.release_memory()
    assert all(p.device.type == "cpu" for p in gpu.model.parameters())
    gpu.resume_memory()
    assert gpu.generate(PROMPTS, sp)[0].response_ids == cpu.generate(PROMPTS, sp)[0].response_ids


def test_kv_cache_bytes_formula_matches_the_allocated_cache():
    from megarl.rollout.torch_model import KVCache, kv_cache_bytes, model_args_from_hf_config

    args = model_args_from_hf_config(FAMILIES["qwen3"]())  # 2 layers, 2 KV heads, head_dim 16
    cache = KVCache.allocate(args, 3, 25, torch.bfloat16, torch.device("cpu"))
    cache.repeat_rows(4)  # 3 prompts x n=4 rows, as generate() builds it
    assert cache.nbytes == kv_cache_bytes(args, 12, 25, torch.bfloat16) == 2 * 2 * 12 * 25 * 2 * 16 * 2
    cache.select_rows(torch.tensor([0, 5, 7]))
    assert cache.nbytes == kv_cache_bytes(args, 3, 25, torch.bfloat16)


def test_kv_cache_budget_refuses_before_generating_and_reports_the_size(tmp_path):
    from megarl.rollout.torch_model import KVCacheBudgetError

    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path)
    sp = SamplingParams(n=2, temperature=0, max_new_tokens=12)
    # 4 prompts x n=2 rows, longest prompt 13 + 12 new tokens; 2 layers x (K, V) x 2 KV heads x head_dim 16 x fp32
    need = 2 * 2 * 8 * (13 + 12) * 2 * 16 * 4
    exact = BuiltinEngine.from_pretrained(tmp_path, kv_cache_gb=need / 2**30)
    samples = exact.generate(PROMPTS, sp)
    assert exact.kv_cache_bytes == need and len(samples) == 8
    tight = BuiltinEngine.from_pretrained(tmp_path, kv_cache_gb=(need - 1) / 2**30)
    with pytest.raises(KVCacheBudgetError, match=r"rollout\.kv_cache_gb=.*rollout\.max_new_tokens.*"
                                                 r"rollout\.n_samples_per_prompt") as err:
        tight.generate(PROMPTS, sp)
    assert "2 layers x 2 x 8 sequences x 25 tokens x 2 KV heads x 16 x 4 bytes" in str(err.value)
    assert tight.kv_cache_bytes == 0  # refused before any cache was allocated
    # a T-PPO continuation re-prefills prompt + response: its cache spans the context plus this window
    windowed = SamplingParams(temperature=0, max_new_tokens=12, window=4)
    first = exact.generate(PROMPTS, windowed)
    exact.continue_samples(first, windowed)
    assert exact.kv_cache_bytes == 2 * 2 * 4 * (13 + 4 + 4) * 2 * 16 * 4


def test_rollout_worker_reports_the_kv_cache_metric(tmp_path):
    """rollout/kv_cache_gb: the builtin engine's KV cache of the call; the largest over DAPO's rounds."""
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.data.dataset import PromptItem
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model
    from megarl.trainer.build import build_rewards
    from megarl.trainer.generation import RolloutWorker
    from megarl.trainer.step_collector import collect_step_batch

    spec = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    save_tiny_model(tmp_path / "model", spec)
    engine = BuiltinEngine.from_pretrained(tmp_path / "model")
    cfg = load_config(None, ["reward.sources={arith: math}", "algorithm.overlong_penalty=false"])
    items = [PromptItem(uid=f"u{i}", prompt=f"{i}+{i}", answer=str(2 * i), data_source="arith") for i in range(3)]
    encoded = [engine.tokenizer.encode(f"Q: {it.prompt}=?\n") for it in items]
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        worker = RolloutWorker(engine, engine.tokenizer, build_rewards(cfg), cfg)
        worker.generate(items, encoded, SamplingParams(n=2, temperature=0, max_new_tokens=5, seed=0))
    finally:
        if owned:
            dist.destroy_process_group()
    longest = max(len(e) for e in encoded)
    expected = 2 * 2 * 6 * (longest + 5) * 2 * (32 // 4) * 4  # layers x (K, V) x rows x slots x kv heads x d x fp32
    assert worker.metrics["rollout/kv_cache_gb"] == expected / 2**30

    class Rounds:  # dynamic sampling: groups are mixed only in round 2; the KV caches are 3 then 1 GiB
        def __init__(self):
            self.metrics, self.round = {}, 0

        def generate(self, items, _encoded, sampling):
            from megarl.trainer.batch import Trajectory

            self.round += 1
            self.metrics = {"rollout/kv_cache_gb": 3.0 if self.round == 1 else 1.0, "reward/count": 2.0}
            return [Trajectory(uid=u, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop",
                               score=float(k), acc=bool(k) and self.round == 2) for u in items for k in range(2)]

    dapo = load_config("configs/algorithms/dapo.yaml", ["rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=1",
                                                        "rollout.gen_batch_prompts=1", "algorithm.mini_batch_size=2"])
    stream = iter(f"p{i}" for i in range(100))
    _, m = collect_step_batch(lambda n: [next(stream) for _ in range(n)], lambda xs: [[0]] * len(xs), Rounds(),
                              dapo, 0, [])
    assert m["rollout/rounds"] == 2 and m["reward/count"] == 4.0  # counts add up over the rounds
    assert m["rollout/kv_cache_gb"] == 3.0  # the peak does not
