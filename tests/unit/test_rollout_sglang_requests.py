"""SGLang engine helpers (megarl.rollout.sglang.requests): request dicts, seeds, output parsing,
weight buckets, gathering over gloo, memory regions, the start-up environment and the request
contract checked before every `Engine.generate` call, all on CPU without SGLang."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.rollout import SamplingParams
from megarl.rollout.sampling import TokenSampler
from megarl.rollout.sglang.requests import (
    MEMORY_TAGS, ReleasedMemory, broadcast_from_owner, check_generate_request, engine_launch_env,
    first_call, gather_to_owner, map_finish_reason, memory_tags, needs_weight_update_session,
    parse_output, plan_buckets, rebucket, request_seeds, run_on_owner, sample_seed, sampling_dict,
    second_call, version_tuple, with_last_flag)


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
    assert not needs_weight_update_session("0.5.17")  # the GPU bundle (../shared/gpu/sglang): no session calls
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
        env.update(CUDA_DEVICE_MAX_CONNECTIONS="8", NCCL_CUMEM_ENABLE="0", SGLANG_RUN_ID="x",
                   CUDA_MODULE_LOADING="AUTO")  # SGLang 0.5.17 sets it too
    assert environ == {"TORCHELASTIC_USE_AGENT_STORE": "True", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                       "RANK": "3", "SGLANG_RUN_ID": "x"}
    with pytest.raises(KeyError):
        with engine_launch_env(environ):
            raise KeyError("engine failed to start")
    assert environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_check_generate_request_refuses_what_sglang_would_misread():
    item = {"format": "processor_output", "pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    check_generate_request([[1, 2]], [{}], None)
    check_generate_request([[1, 2], [3]], [{}, {}], [[], [item]])
    bad = {
        "a text request as None": ([[1], [2]], [{}, {}], [None, [item]]),
        "an item wrapped twice": ([[1], [2]], [{}, {}], [[[item]], []]),
        "a bare item": ([[1], [2]], [{}, {}], [item, []]),
        "two items for one request": ([[1]], [{}], [[item, item]]),
        "not processor output": ([[1]], [{}], [["file.png"]]),
        "fewer image entries than requests": ([[1], [2]], [{}, {}], [[item]]),
        "flat input ids (one request)": ([1, 2], [{}], None),
        "fewer sampling dicts than requests": ([[1], [2]], [{}], None),
    }
    for what, (ids, params, data) in bad.items():
        with pytest.raises(ValueError):
            check_generate_request(ids, params, data)
            pytest.fail(what)
