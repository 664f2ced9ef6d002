"""SGLang engine: the pure logic (request dicts, seeds, output parsing, buckets, gathering, memory
regions, start-up environment) on CPU.

SGLang itself cannot run here; its GPU paths (weight streaming) are verified only on GPU clusters.
`run_segment` and `SGLangEngine`'s start / memory / seeding logic are exercised with a stand-in for
`sglang.Engine` that generates with the builtin engine and answers in SGLang's output format.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import pickle
import subprocess
import sys
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Qwen2Config

from megarl.rollout import BuiltinEngine, SamplingParams, make_engine
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.sglang_utils import (
    MEMORY_TAGS, GenerateCall, ReleasedMemory, broadcast_from_owner, engine_launch_env, first_call,
    gather_to_owner, map_finish_reason, memory_tags, needs_weight_update_session, parse_output,
    plan_buckets, rebucket, request_seeds, run_on_owner, run_segment, sample_seed, sampling_dict,
    second_call, server_args, version_tuple, with_last_flag)
from megarl.rollout.sampling import TokenSampler


def test_sampling_dict():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, stop=["</s>"], stop_token_ids=[5],
                        seed=3)
    assert sampling_dict(TokenSampler(0.7, -1, 0.9), sp, 12, seed=11) == {
        "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "n": 1,
        "skip_special_tokens": True, "stop": ["</s>"], "stop_token_ids": [5], "sampling_seed": 11}
    plain = sampling_dict(TokenSampler(0.0, 0, 1.0), SamplingParams(seed=3), 4)
    assert plain["top_k"] == -1 and plain["temperature"] == 0.0
    assert "stop" not in plain and "stop_token_ids" not in plain and "sampling_seed" not in plain


def test_sample_seeds_distinct_per_sample_and_reproducible():
    """SGLang's seeded sampler hashes (seed, position): the n samples of a prompt need n seeds."""
    keys = [(i, j) for i in range(5) for j in range(16)]
    seeds = request_seeds(1234, keys)
    assert len(set(seeds)) == len(keys)
    assert seeds == request_seeds(1234, keys)  # same call seed: same request seeds
    assert not set(seeds) & set(request_seeds(1235, keys))
    assert not set(seeds) & set(request_seeds(1234, keys, stream="continue"))
    assert all(0 <= s < 2 ** 63 for s in seeds)  # SamplingParams.sampling_seed is an int64
    assert len(set(request_seeds(None, keys))) == len(keys)
    assert request_seeds(None, keys) != request_seeds(None, keys)  # no call seed: fresh draws
    assert sample_seed(7, 0, 1) == request_seeds(7, [(0, 1)])[0]
    call = first_call([[1], [1], [2]], [4, 4, 4], SamplingParams(seed=9), False, seeds=[10, 11, 12])
    assert [d["sampling_seed"] for d in call.sampling_params] == [10, 11, 12]
    rest = second_call([[1], [2]], [5, 6], [3, 3], SamplingParams(), seeds=[10, 12])
    assert [d["sampling_seed"] for d in rest.sampling_params] == [10, 12]
    with pytest.raises(ValueError, match="2 seeds for 3 requests"):
        first_call([[1], [1], [2]], [4, 4, 4], SamplingParams(), False, seeds=[1, 2])


def test_fire_is_two_calls_with_fire_params_set_last():
    sp = SamplingParams(temperature=0.6, top_p=0.95, max_new_tokens=20, fire=True,
                        fire_temperature=30.0, fire_top_k=16)
    call = first_call([[1, 2], [3]], [20, 20], sp, fire=True)
    assert call.input_ids == [[1, 2], [3]]
    for d in call.sampling_params:
        assert (d["max_new_tokens"], d["temperature"], d["top_k"], d["top_p"]) == (1, 30.0, 16, 0.95)
    rest = second_call([[1, 2], [3]], [7, 8], [19, 19], sp)
    assert rest.input_ids == [[1, 2, 7], [3, 8]]
    for d in rest.sampling_params:
        assert (d["max_new_tokens"], d["temperature"], d["top_k"]) == (19, 0.6, -1)
    topk = first_call([[1]], [5], SamplingParams(top_k=4, fire=True), fire=True)
    assert topk.sampling_params[0]["top_k"] == 4 and topk.sampling_params[0]["temperature"] == 30.0
    no_fire = first_call([[1], [2]], [5, 3], sp, fire=False)  # continuation: no FIRE
    assert [d["max_new_tokens"] for d in no_fire.sampling_params] == [5, 3]
    assert all(d["temperature"] == 0.6 for d in no_fire.sampling_params)


def test_finish_reason_and_output_parsing():
    assert map_finish_reason({"type": "stop", "matched": 151643}, False) == "stop"
    assert map_finish_reason({"type": "stop", "matched": "</answer>"}, True) == "stop"
    assert map_finish_reason({"type": "length", "length": 8}, False) == "length"
    assert map_finish_reason({"type": "length", "length": 8}, True) == "truncated"
    with pytest.raises(RuntimeError, match="aborted the request: out of memory"):
        map_finish_reason({"type": "abort", "message": "out of memory"}, False)
    with pytest.raises(ValueError, match="did not finish"):
        map_finish_reason(None, False)
    with pytest.raises(ValueError, match="unknown type 'weird'"):
        map_finish_reason({"type": "weird"}, False)
    output = {"text": "ab", "output_ids": [11, 12],
              "meta_info": {"finish_reason": {"type": "stop", "matched": 12},
                            "output_token_logprobs": [(-0.5, 11, None), [-1.25, 12, "b"]]}}
    assert parse_output(output, False) == ([11, 12], [-0.5, -1.25], "stop")
    with pytest.raises(ValueError, match="return_logprob=True"):
        parse_output({"meta_info": {"finish_reason": {"type": "length"}}}, False)
    output["output_ids"] = [11]
    with pytest.raises(ValueError, match="1 output_ids but 2 output_token_logprobs"):
        parse_output(output, False)


def test_plan_buckets_by_bytes():
    sizes = [("a", 40), ("b", 30), ("c", 50), ("d", 200), ("e", 10), ("f", 90)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert plan_buckets(sizes, 1000) == [["a", "b", "c", "d", "e", "f"]]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket size must be > 0"):
        plan_buckets(sizes, 0)


def test_rebucket_splits_by_bytes_and_dtype():
    stream = [[("w1", torch.zeros(10)), ("h1", torch.zeros(10, dtype=torch.bfloat16)),
               ("w2", torch.zeros(20)), ("w3", torch.zeros(5))],
              [("w4", torch.zeros(100))]]
    out = list(rebucket(iter(stream), max_bytes=100))
    names = [[n for n, _ in b] for b in out]
    assert names == [["w1"], ["w2", "w3"], ["h1"], ["w4"]]  # 40+80 > 100, 80+20 = 100; w4: 400 B
    assert all(len({t.dtype for _, t in b}) == 1 for b in out)


def test_with_last_flag_and_versions():
    assert list(with_last_flag([])) == []
    assert list(with_last_flag(["a"])) == [("a", True)]
    assert list(with_last_flag(iter("abc"))) == [("a", False), ("b", False), ("c", True)]
    assert version_tuple("0.5.23.post1") == (0, 5, 23) and version_tuple("0.5.21rc1") == (0, 5, 21)
    assert not needs_weight_update_session("0.5.20") and needs_weight_update_session("0.5.21")
    assert needs_weight_update_session("0.6.0")
    with pytest.raises(ValueError, match="cannot parse"):
        version_tuple("dev")


def _fail(message: str):
    raise ValueError(message)


def _gather_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    gathered = gather_to_owner(f"payload-{rank}".encode(), group)
    samples = broadcast_from_owner({"from": rank} if rank == 0 else None, group)
    owner_value = run_on_owner(lambda: 10 + rank, group)
    try:
        run_on_owner(lambda: _fail("prompt 3 is empty"), group)
        error = None
    except ValueError as err:
        error = str(err)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((gathered, samples, owner_value, error), f)
    dist.destroy_process_group()


def test_gather_and_broadcast_over_gloo(tmp_path):
    world = 3  # fork: the children need no re-import of this module
    mp.start_processes(_gather_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
                       nprocs=world, start_method="fork")
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    assert results[0][0] == [b"payload-0", b"payload-1", b"payload-2"]  # ordered by group rank
    assert results[1][0] is None and results[2][0] is None
    assert all(r[1] == {"from": 0} for r in results)
    assert all(r[2] == 10 for r in results)  # the owner's result everywhere
    assert all(r[3] == "prompt 3 is empty" for r in results)  # the owner's error on every rank
    assert gather_to_owner("x", None) == ["x"] and broadcast_from_owner(5, None) == 5


def _sglang_format(sample) -> dict:
    finish = ({"type": "stop", "matched": sample.response_ids[-1]} if sample.finish_reason == "stop"
              else {"type": "length", "length": len(sample.response_ids)})
    return {"output_ids": sample.response_ids,
            "meta_info": {"finish_reason": finish, "output_token_logprobs": [
                (lp, t, None) for lp, t in zip(sample.logprobs, sample.response_ids)]}}


def test_run_segment_fire_with_builtin_backend(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.1, eos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    calls: list[GenerateCall] = []

    def call(c: GenerateCall) -> list[dict]:
        calls.append(c)
        outs = []
        for ids, d in zip(c.input_ids, c.sampling_params):
            sp = SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                max_new_tokens=d["max_new_tokens"], seed=d.get("sampling_seed"))
            outs.append(_sglang_format(engine.generate([ids], sp)[0]))
        return outs

    contexts = [[1, 2, 3], [4, 5], [6]]
    sp = SamplingParams(temperature=0, max_new_tokens=9, window=6, fire=True, seed=1)
    segments = run_segment(call, contexts, [6, 6, 1], [True, True, False], sp, fire=True)
    assert len(calls) == 2
    assert [d["max_new_tokens"] for d in calls[0].sampling_params] == [1, 1, 1]
    assert calls[1].input_ids == [contexts[0] + segments[0][0][:1], contexts[1] + segments[1][0][:1]]
    for ctx, (ids, logprobs, reason) in zip(contexts[:2], segments[:2]):
        assert len(ids) == len(logprobs) == 6 and reason == "truncated"
        greedy = engine.generate([ctx + ids[:1]], SamplingParams(temperature=0, max_new_tokens=5))
        assert ids[1:] == greedy[0].response_ids
    assert len(segments[2][0]) == 1 and segments[2][2] == "length"  # budget 1: FIRE call only


def test_make_engine_registry():
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        make_engine("vllm")
    with pytest.raises(ValueError, match="pass model_path"):
        make_engine("builtin")
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match="rollout.engine=sglang needs the `sglang` package"):
            make_engine("sglang", model_path="unused")


# ---------------------------------------------------------------------------- engine lifecycle


def test_memory_tags_send_only_state_changes():
    assert memory_tags(None) == list(MEMORY_TAGS) == ["kv_cache", "weights", "cuda_graph"]
    assert memory_tags(["cuda_graph", "kv_cache"]) == ["kv_cache", "cuda_graph"]
    assert memory_tags("weights") == ["weights"]
    with pytest.raises(ValueError, match=r"unknown SGLang memory tags \['kv'\]"):
        memory_tags(["kv"])
    memory = ReleasedMemory()
    assert memory.to_resume() == []
    memory.released(memory.to_release())
    assert memory.to_release() == [] and memory.to_resume(["weights"]) == ["weights"]
    memory.resumed(["weights"])
    assert memory.to_resume() == ["kv_cache", "cuda_graph"]


def test_engine_launch_env_hides_the_agent_store_and_restores_the_trainer_env():
    environ = {"TORCHELASTIC_USE_AGENT_STORE": "True", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "RANK": "3"}
    with engine_launch_env(environ) as env:
        assert "TORCHELASTIC_USE_AGENT_STORE" not in env and env["RANK"] == "3"
        env.update(CUDA_DEVICE_MAX_CONNECTIONS="8", NCCL_CUMEM_ENABLE="0", SGLANG_RUN_ID="x")
    assert environ == {"TORCHELASTIC_USE_AGENT_STORE": "True", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                       "RANK": "3", "SGLANG_RUN_ID": "x"}
    with pytest.raises(KeyError):
        with engine_launch_env(environ):
            raise KeyError("engine failed to start")
    assert environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


class _StandInEngine:
    """Stands in for `sglang.Engine`, which cannot run here.

    Like the real one it starts a child process at creation (the scheduler; it inherits this
    process's environment) and refuses to resume a region that is not released or to release one
    twice (srt/managers/scheduler_components/weight_updater.py). Generation runs the builtin
    engine on the same checkpoint and answers in SGLang's output format.
    """

    created: list["_StandInEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        probe = "import os; print(os.environ.get('TORCHELASTIC_USE_AGENT_STORE'))"
        self.child_agent_store = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                                text=True, check=True).stdout.strip()
        self.offloaded: set[str] = set()
        self.memory_calls: list[tuple[str, list[str]]] = []
        self.requests: list[dict] = []
        self.image_requests: list = []
        self.backend = BuiltinEngine.from_pretrained(kwargs["model_path"])
        _StandInEngine.created.append(self)

    def release_memory_occupation(self, tags=None):
        assert tags and not self.offloaded & set(tags), f"release of released regions {tags}"
        self.offloaded |= set(tags)
        self.memory_calls.append(("release", list(tags)))

    def resume_memory_occupation(self, tags=None):
        assert tags and set(tags) <= self.offloaded, f"resume of resident regions {tags}"
        self.offloaded -= set(tags)
        self.memory_calls.append(("resume", list(tags)))

    def generate(self, input_ids, sampling_params, return_logprob, return_routed_experts=False, image_data=None):
        assert return_logprob and not self.offloaded
        # SGLang refuses return_routed_experts unless the server was started with the flag
        assert not return_routed_experts or self.kwargs.get("enable_return_routed_experts")
        outs = []
        for k, (ids, d) in enumerate(zip(input_ids, sampling_params)):
            self.requests.append(d)
            sp = SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                max_new_tokens=d["max_new_tokens"], seed=d.get("sampling_seed"))
            images = None
            if image_data is not None:  # per request: None, or [one processor-output item]
                self.image_requests.append(image_data[k])
                if image_data[k] is not None:
                    (item,) = image_data[k]
                    assert item["format"] == "processor_output"
                    images = [{"pixel_values": item["pixel_values"], "image_grid_thw": item["image_grid_thw"]}]
            sample = self.backend.generate([ids], sp, **({"images": images} if images else {}))[0]
            out = _sglang_format(sample)
            if return_routed_experts:  # SGLang: base64 of int32 [prompt + output - 1, layers, top_k]
                n = len(sample.prompt_ids) + len(sample.response_ids) - 1
                raw = sample.routed_experts[:n].to(torch.int32).numpy().tobytes()
                out["meta_info"]["routed_experts"] = base64.b64encode(raw).decode("ascii")
            outs.append(out)
        return outs


@pytest.fixture()
def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.5, eos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    _StandInEngine.created.clear()
    return tmp_path


def _engine(path, **kwargs) -> SGLangEngine:
    sglang = types.SimpleNamespace(Engine=_StandInEngine, __version__="0.5.23")
    return SGLangEngine(path, base_gpu_id=0, sglang_module=sglang, **kwargs)


def test_engine_starts_on_demand_without_torchrun_agent_store(tiny_checkpoint, monkeypatch):
    """The KV pool is sized when the engine starts: nothing starts at construction (build time)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    engine = _engine(tiny_checkpoint, mem_fraction_static=0.7)
    engine.release_memory()  # nothing to release yet
    assert _StandInEngine.created == [] and not engine.started
    with pytest.raises(RuntimeError, match="not started; call start"):
        engine.update_weights([])
    engine.start()
    engine.start()
    (sgl,) = _StandInEngine.created
    assert sgl.child_agent_store == "None"  # the scheduler did not inherit torchrun's agent store
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the trainer's env is back
    assert sgl.kwargs["enable_memory_saver"] and sgl.kwargs["mem_fraction_static"] == 0.7
    assert sgl.kwargs["base_gpu_id"] == 0 and sgl.kwargs["skip_tokenizer_init"]  # no tokenizer files


def test_engine_memory_regions_follow_the_colocated_order(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    engine.resume_memory(["weights"])  # first use starts it; only the weights stay resident
    (sgl,) = _StandInEngine.created
    assert sgl.memory_calls == [("release", ["kv_cache", "cuda_graph"])]
    sp = SamplingParams(max_new_tokens=4, seed=1)
    with pytest.raises(RuntimeError, match="call resume_memory"):
        engine.generate([[1, 2]], sp)
    engine.resume_memory()  # generation: the rest comes back
    engine.resume_memory()
    assert engine.generate([[1, 2]], sp)[0].prompt_ids == [1, 2]  # weights loaded from disk
    engine.release_memory()
    engine.release_memory()
    assert sgl.memory_calls[1:] == [("resume", ["kv_cache", "cuda_graph"]),
                                    ("release", ["kv_cache", "weights", "cuda_graph"])]
    with pytest.raises(RuntimeError, match=r"resume_memory\(\['weights'\]\) first"):
        engine.update_weights([])
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert sgl.memory_calls[3:] == [("resume", ["weights"]), ("resume", ["kv_cache", "cuda_graph"])]
    with pytest.raises(RuntimeError, match="call update_weights"):  # resumed weights are garbage
        engine.generate([[1, 2]], sp)


def test_engine_gives_each_sample_its_own_seed(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, start=True)
    prompts, n = [[1, 2, 3], [4, 5]], 3
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=4, seed=5)
    samples = engine.generate(prompts, sp)
    (sgl,) = _StandInEngine.created
    seeds = [d["sampling_seed"] for d in sgl.requests]
    assert len(seeds) == len(set(seeds)) == len(prompts) * n
    assert [s.index for s in samples] == [0] * n + [1] * n
    for i in range(len(prompts)):
        assert len({tuple(s.response_ids) for s in samples[i * n:(i + 1) * n]}) > 1
    again = engine.generate(prompts, sp)
    assert [d["sampling_seed"] for d in sgl.requests[len(seeds):]] == seeds
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    engine.generate(prompts, SamplingParams(n=n, max_new_tokens=1, seed=6))
    assert not set(seeds) & {d["sampling_seed"] for d in sgl.requests[2 * len(seeds):]}


def _group_timeout_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from megarl.trainer.build import engine_group

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    patient, hasty = engine_group(world), engine_group(world, timeout=timedelta(milliseconds=500))
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout for g in (patient, hasty)]
    slow_owner = lambda: time.sleep(2) or "generated"  # noqa: E731
    outcomes = [run_on_owner(slow_owner, patient)]
    try:
        outcomes.append(run_on_owner(slow_owner, hasty))
    except RuntimeError as err:
        outcomes.append(f"error: {err}")
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((timeouts, outcomes), f)


def test_engine_group_timeout_outlasts_the_owners_generation(tmp_path):
    import megarl.trainer.build  # noqa: F401 - imported once, before forking

    world = 2
    mp.start_processes(_group_timeout_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
                       nprocs=world, start_method="fork")
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for timeouts, outcomes in results:
        assert timeouts[0] >= timedelta(hours=1) and timeouts[1] == timedelta(milliseconds=500)
        assert outcomes[0] == "generated"
    assert "timed out" in results[1][1][1].lower(), results[1][1][1]  # waited past the timeout


def test_server_args_from_config():
    from megarl.config import ConfigError, load_config

    base = ["data.max_prompt_len=1024", "rollout.max_new_tokens=30000", "eval.max_new_tokens=32768",
            "parallel.rollout_tp=4", "rollout.mem_fraction=0.7"]
    # context: the longest request, prompt + the larger of the training and eval generation caps
    assert server_args(load_config(None, base)) == {"tp_size": 4, "mem_fraction_static": 0.7,
                                                    "context_length": 1024 + 32768}
    explicit = load_config(None, base + ["rollout.sglang_context_length=40000", "rollout.sglang_chunked_prefill_size=8192"])
    assert server_args(explicit) == {"tp_size": 4, "mem_fraction_static": 0.7, "context_length": 40000,
                                     "chunked_prefill_size": 8192}
    assert server_args(load_config(None, ["rollout.sglang_chunked_prefill_size=-1"]))["chunked_prefill_size"] == -1
    with pytest.raises(ConfigError, match=r"rollout\.sglang_context_length.*31024"):  # would cut responses early
        load_config(None, base + ["rollout.sglang_context_length=31023"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang_chunked_prefill_size"):
        load_config(None, ["rollout.sglang_chunked_prefill_size=0"])


def test_context_length_from_config_reaches_sglang_and_caps_generation(tiny_checkpoint):
    from megarl.config import load_config

    cfg = load_config(None, ["data.max_prompt_len=8", "rollout.max_new_tokens=12", "eval.max_new_tokens=4",
                             "rollout.sglang_chunked_prefill_size=16"])
    engine = _engine(tiny_checkpoint, start=True, **server_args(cfg))
    (sgl,) = _StandInEngine.created
    assert (sgl.kwargs["context_length"], sgl.kwargs["chunked_prefill_size"], sgl.kwargs["tp_size"]) == (20, 16, 1)
    (sample,) = engine.generate([list(range(1, 9))], SamplingParams(temperature=0, max_new_tokens=30))
    assert sgl.requests[0]["max_new_tokens"] == 20 - 8  # the request never asks past the context
    assert len(sample.response_ids) == 12 and sample.finish_reason == "length"


def test_build_engine_passes_the_server_args(tiny_checkpoint, tmp_path_factory, monkeypatch):
    from megarl.config import load_config
    from megarl.trainer.build import build_engine

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_StandInEngine, __version__="0.5.23"))
    cfg = load_config(None, ["rollout.engine=sglang", f"model.hf_path={tiny_checkpoint}", "data.max_prompt_len=8",
                             "rollout.max_new_tokens=12", "rollout.sglang_chunked_prefill_size=16",
                             "rollout.mem_fraction=0.5"])
    owned = not dist.is_initialized()
    if owned:
        init = tmp_path_factory.mktemp("dist") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        engine = build_engine(cfg, None, None)
    finally:
        if owned:
            dist.destroy_process_group()
    assert isinstance(engine, SGLangEngine) and not engine.started
    expected = {"tp_size": 1, "mem_fraction_static": 0.5, "context_length": 8 + 20480, "chunked_prefill_size": 16}
    assert {k: engine.engine_kwargs[k] for k in expected} == expected  # eval.max_new_tokens (20480) is the larger cap
    assert engine.max_context == 8 + 20480


def test_engine_reads_sglang_routed_experts_for_routing_replay(tmp_path):
    """return_routed_experts=True: the server flag is set, every call asks for the routing, and each
    sample's routed_experts are the experts its tokens were routed to (the stand-in answers with the
    builtin engine's, in SGLang's base64 int32 format), FIRE's two calls included."""
    from tests.distributed.scripts_moe import make_tiny_moe

    path = make_tiny_moe("qwen3_moe", tmp_path / "moe")
    _StandInEngine.created.clear()
    engine = _engine(path, return_routed_experts=True)
    engine.start()
    (sgl,) = _StandInEngine.created
    assert sgl.kwargs["enable_return_routed_experts"]
    for fire in (False, True):
        samples = engine.generate([[5, 6, 7], [9, 10, 11, 12, 13]], SamplingParams(n=2, max_new_tokens=6, seed=3,
                                                                                  fire=fire))
        for s in samples:
            total = len(s.prompt_ids) + len(s.response_ids)
            assert s.routed_experts.shape == (total, 2, 2) and s.routed_experts.dtype == torch.int16
            # the experts of every forwarded token, recomputed by a full forward of the sequence
            expected = _full_forward_routing(sgl.backend, s.prompt_ids + s.response_ids[:-1])
            assert torch.equal(s.routed_experts[: total - 1], expected)
            assert torch.equal(s.routed_experts[-1], torch.tensor([[0, 1], [0, 1]], dtype=torch.int16))


def _full_forward_routing(engine: BuiltinEngine, ids: list[int]) -> torch.Tensor:
    from megarl.rollout.torch_model import KVCache
    from megarl.rollout.torch_moe import RoutingTape

    tape = RoutingTape(engine.model)
    n = len(ids)
    cache = KVCache.allocate(engine.args, 1, n, engine.dtype, engine.device)
    with torch.inference_mode():
        engine.model(torch.tensor([ids]), torch.arange(n)[None], cache, 0,
                     torch.ones(n, n, dtype=torch.bool).tril()[None, None])
    out = tape.take()
    tape.close()
    return out


def test_engine_sends_images_as_processor_output(tmp_path):
    """A vision-language checkpoint (config.json with text_config): prompts with expanded image pads
    and their pixels go to SGLang as one processor-output item per request (None for a text prompt),
    in both FIRE calls; each sample keeps its prompt's images (for continue_samples)."""
    from megarl.rollout.sglang_engine import image_data
    from megarl.rollout.types import PromptImages
    from tests.distributed.scripts_vlm_common import make_prompt, make_tiny_vlm

    make_tiny_vlm(tmp_path, seed=2)
    _StandInEngine.created.clear()
    made = [make_prompt([(20, 37)], 1), make_prompt([], 3), make_prompt([(48, 40), (9, 9)], 2)]
    prompts = [m[0] for m in made]
    images = [None if m[1] is None else PromptImages(m[1]["pixel_values"], m[1]["image_grid_thw"]) for m in made]
    engine = _engine(tmp_path, start=True)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=3, fire=True)
    samples = engine.generate(prompts, sp, images=images)
    (sgl,) = _StandInEngine.created
    sent = [r is not None for r in sgl.image_requests]
    first = sent[: len(prompts) * 2]
    assert first == [True, True, False, False, True, True]  # rows: prompt-major, n=2
    assert len(sent) > len(first)  # FIRE's second call carried the images too
    assert all(s.images is images[s.index] for s in samples)
    item = image_data([images[2]])[0][0]
    assert item["format"] == "processor_output" and item["image_grid_thw"].tolist() == [[1, 12, 10], [1, 4, 4]]
    assert all(len(s.response_ids) > 0 for s in samples)
