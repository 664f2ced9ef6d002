"""SGLang engine on CPU (its pure helpers: test_rollout_sglang_requests.py).

SGLang itself cannot run here; its GPU paths (weight streaming) are verified only on GPU clusters.
`run_segment` and `SGLangEngine`'s start / memory / seeding / image / routing logic are exercised
with a stand-in for `sglang.Engine` that reads requests the way SGLang 0.5.23 normalises them,
generates with the builtin engine and answers in SGLang's output format.
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
from megarl.rollout.sglang.engine import SGLangEngine
from megarl.rollout.sglang.requests import GenerateCall, run_on_owner, run_segment, server_args


def _sglang_format(sample) -> dict:
    finish = ({"type": "stop", "matched": sample.response_ids[-1]} if sample.finish_reason == "stop"
              else {"type": "length", "length": len(sample.response_ids)})
    return {"output_ids": sample.response_ids,
            "meta_info": {"finish_reason": finish, "output_token_logprobs": [
                (lp, t, None) for lp, t in zip(sample.logprobs, sample.response_ids)]}}


def save_tiny_qwen2(path, initializer_range: float) -> None:
    """A random 2-layer Qwen2 (vocabulary 64, no EOS token) drawn after torch.manual_seed(0), saved at path."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=initializer_range, eos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def test_run_segment_fire_with_builtin_backend(tmp_path):
    save_tiny_qwen2(tmp_path, 0.1)
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


def _sglang_has_valid_data(data) -> bool:
    """srt/multimodal/mm_utils.py `has_valid_data` (SGLang 0.5.23): any non-None leaf."""
    if isinstance(data, list):
        return any(_sglang_has_valid_data(d) for d in data)
    return data is not None


def _sglang_batch_image_data(input_ids, image_data) -> list:
    """Each request's own `image_data` after SGLang normalises an `Engine.generate(input_ids=...,
    image_data=...)` call. Reproduces SGLang 0.5.23 srt/managers/io_struct.py, GenerateReqInput:
    `_determine_batch_size` (flat ids: one request), `_normalize_image_data` (a batch, one sample
    per request) and `__getitem__`. The rule that bit megarl: only the FIRST entry decides whether
    the list is per-request lists (kept) or one image per request (every entry wrapped again)."""
    if isinstance(input_ids[0], int):  # a single request: image_data is its own, untouched
        return [image_data]
    n = len(input_ids)
    if image_data is None or (isinstance(image_data, list) and len(image_data) == 0):
        return [None] * n
    if not isinstance(image_data, list):
        return [[image_data]] * n
    if len(image_data) != n:
        raise ValueError("The length of image_data should be equal to the batch size.")
    if isinstance(image_data[0], list):
        return list(image_data)
    return [[im] for im in image_data]


def _sglang_processor_items(request_images) -> list[dict]:
    """The processor-output items SGLang reads from one request's `image_data`: nothing unless it
    holds a non-None leaf (srt/managers/tokenizer_manager.py `_tokenize_one_request`, which also
    wraps a bare item in a list); a "processor_output" dict is used as is and must be the request's
    only item (srt/multimodal/processors/base_processor.py `_validate_one_modality`,
    `_get_preprocessed_input_format`); anything else would be loaded as an image file / URL."""
    if not _sglang_has_valid_data(request_images):
        return []
    items = request_images if isinstance(request_images, list) else [request_images]
    for item in items:
        if not (isinstance(item, dict) and item.get("format") == "processor_output"):
            raise ValueError(f"SGLang would load a {type(item).__name__} as an image file / URL / base64: "
                             f"{str(item)[:60]}")
    if len(items) != 1:
        raise ValueError(f"a processor_output item must be the request's only image item, got {len(items)}")
    return items


class _StandInEngine:
    """Stands in for `sglang.Engine`, which cannot run here.

    Like the real one it starts a child process at creation (the scheduler; it inherits this
    process's environment) and refuses to resume a region that is not released or to release one
    twice (srt/managers/scheduler_components/weight_updater.py). It reads `image_data` the way
    SGLang normalises it (`_sglang_batch_image_data`). Generation runs the builtin engine on the
    same checkpoint and answers in SGLang's output format.
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
        self.video_requests: list = []
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

    def generate(self, input_ids, sampling_params, return_logprob, return_routed_experts=False, image_data=None,
                 video_data=None):
        assert return_logprob and not self.offloaded
        # SGLang refuses return_routed_experts unless the server was started with the flag
        assert not return_routed_experts or self.kwargs.get("enable_return_routed_experts")
        outs = []
        for k, (ids, d) in enumerate(zip(input_ids, sampling_params)):
            self.requests.append(d)
            sp = SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                max_new_tokens=d["max_new_tokens"], seed=d.get("sampling_seed"))
            images = None
            if image_data is not None:  # what SGLang's request normalisation hands request k
                items = _sglang_processor_items(_sglang_batch_image_data(input_ids, image_data)[k])
                self.image_requests.append(items or None)
                if items:
                    (item,) = items
                    images = [{"pixel_values": item["pixel_values"], "image_grid_thw": item["image_grid_thw"]}]
            if video_data is not None:  # the same normalisation for videos (one processor-output item)
                items = _sglang_processor_items(_sglang_batch_image_data(input_ids, video_data)[k])
                self.video_requests.append(items or None)
                if items:
                    (item,) = items
                    video = {key: v for key, v in item.items() if key != "format"}
                    images = [{**(images[0] if images else {}), **video}]
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
    save_tiny_qwen2(tmp_path, 0.5)
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
    # further ServerArgs fields pass through; those megarl sets are refused, naming the field to use
    extra = load_config(None, base + ["rollout.sglang_server_args={attention_backend: triton, disable_cuda_graph: true}"])
    assert server_args(extra) == {"attention_backend": "triton", "disable_cuda_graph": True, "tp_size": 4,
                                  "mem_fraction_static": 0.7, "context_length": 1024 + 32768}
    with pytest.raises(ConfigError, match=r"rollout\.sglang_server_args.*megarl sets mem_fraction_static "
                                          r"\(rollout\.mem_fraction\), tp_size \(parallel\.rollout_tp\) itself"):
        load_config(None, ["rollout.sglang_server_args={tp_size: 2, mem_fraction_static: 0.5, log_level: info}"])


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
                             "rollout.mem_fraction=0.5", "rollout.sglang_server_args={attention_backend: triton}"])
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
    expected = {"tp_size": 1, "mem_fraction_static": 0.5, "context_length": 8 + 20480, "chunked_prefill_size": 16,
                "attention_backend": "triton"}
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
    from megarl.rollout.sglang.engine import image_data
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


@pytest.mark.parametrize("layout", [[None, 1], [None, None], [1], [None], [1, None, 2], [None, 2, None]],
                         ids=["text-first", "all-text", "single-image", "single-text", "image-first", "text-image-text"])
def test_engine_images_reach_each_request_whatever_the_text_image_mix(tmp_path, layout):
    """SGLang reads image_data as per-request lists only if its first entry is a list: whatever the
    order of text and image prompts, each request must get exactly its own processor-output item
    (and a text request none) after SGLang's normalisation (reproduced by the stand-in)."""
    from megarl.rollout.types import PromptImages
    from tests.distributed.scripts_vlm_common import make_prompt, make_tiny_vlm

    make_tiny_vlm(tmp_path, seed=2)
    _StandInEngine.created.clear()
    sizes = {1: [(20, 37)], 2: [(48, 40), (9, 9)]}
    made = [make_prompt(sizes.get(kind, []), i + 1) for i, kind in enumerate(layout)]
    images = [None if m[1] is None else PromptImages(m[1]["pixel_values"], m[1]["image_grid_thw"]) for m in made]
    engine = _engine(tmp_path, start=True)
    samples = engine.generate([m[0] for m in made], SamplingParams(n=1, temperature=1.0, max_new_tokens=3, seed=3),
                              images=images)
    (sgl,) = _StandInEngine.created
    if all(im is None for im in images):
        assert sgl.image_requests == []  # a text-only call sends no image_data at all
    else:
        assert len(sgl.image_requests) == len(layout)
        for got, im in zip(sgl.image_requests, images):
            if im is None:
                assert got is None
            else:
                (item,) = got
                assert item["pixel_values"] is im.pixel_values and item["image_grid_thw"] is im.image_grid_thw
    assert [s.index for s in samples] == list(range(len(layout)))


def test_image_data_survives_sglang_normalisation_for_every_mix():
    """megarl's image_data list, normalised as SGLang does, gives request i exactly image i's item
    (a text request none) for every mix of text and image requests, 1 to 4 requests."""
    import itertools

    from megarl.rollout.sglang.engine import image_data
    from megarl.rollout.types import PromptImages

    for n in range(1, 5):
        for mask in itertools.product([False, True], repeat=n):
            images = [PromptImages(torch.rand(4, 8), torch.tensor([[1, 2, 2]])) if m else None for m in mask]
            data = image_data(images)
            ids = [[1, 2, 3]] * n
            per_request = _sglang_batch_image_data(ids, data)
            for im, got in zip(images, per_request):
                items = _sglang_processor_items(got)
                assert len(items) == (im is not None), (mask, got)
                if im is not None:
                    assert items[0]["pixel_values"] is im.pixel_values
