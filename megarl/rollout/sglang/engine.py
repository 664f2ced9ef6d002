"""Colocated SGLang rollout engine (production path). Verified only on GPU clusters.

Layout: one SGLang engine per rollout TP group. The ranks whose GPUs the engine uses form a gloo
`group` (group rank i sits on the GPU of SGLang TP rank i, i.e. on `base_gpu_id + i`); group
rank 0 owns the `sglang.Engine` (its TokenizerManager runs in that process, the schedulers in
SGLang's own subprocesses). All methods are collective over `group`; an error on the owner is
raised on every rank. Every rank must see all GPUs of its node (torchrun default; each rank
selects its device with `torch.cuda.set_device(local_rank)`), because the owner's SGLang places
TP rank i on GPU `base_gpu_id + i` (default base: the owner's current device). SGLang forces the
`spawn` start method in the owner process, so the training script needs a `__main__` guard.
The other ranks wait on `group` while the owner starts the engine or generates: give that gloo
group a timeout longer than the longest generation (`megarl.trainer.build.engine_group`).

- server arguments: keyword arguments beyond the named ones go to `sglang.Engine` unchanged; from a
  config, `requests.server_args` builds them (tp_size, mem_fraction_static, context_length,
  chunked_prefill_size). `context_length` also caps every request's budget here (prompt + new tokens).
- start: creates the `sglang.Engine`. SGLang sizes its KV pool at that moment from the free GPU
  memory (mem_fraction_static), so start it while the training state is off the GPU. The engine
  is lazy: constructing this class starts nothing; `start()` or the first `resume_memory()` does.
  The owner removes torchrun's TORCHELASTIC_USE_AGENT_STORE while the engine starts
  (`engine_launch_env`); every rank should run with NCCL_CUMEM_ENABLE=0 (the launchers export it).
- generate / continue_samples: called on the owner only, which sends the requests; the samples
  stay on the owner (the other ranks of the group do not take part: SGLang's own processes drive
  their GPUs; megarl's RolloutWorker tells them only whether the owner's work succeeded). Each request carries its own `sampling_seed`,
  derived from `SamplingParams.seed`, the prompt index and the sample index (`sample_seed`):
  SGLang's seeded sampling under deterministic inference would otherwise give the n samples of
  a prompt the same tokens. Without deterministic inference SGLang ignores the seeds.
- update_weights(stream): with ep_size each rank's stream brings only the routed experts its GPU
  hosts (`hosted_experts`; SGLang's loader skips the others anyway); each rank flattens its bucket on
  its own GPU (`FlattenedTensorBucket`),
  serializes it to CUDA-IPC handles (`MultiprocessingSerializer`, after
  `monkey_patch_torch_reductions()` so handles carry the GPU UUID), the payloads are gathered to
  the owner over gloo, and the owner calls
  `update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=<last bucket>)`,
  inside `begin_weight_update()` / `end_weight_update()` on SGLang >= 0.5.21. Needs the
  "weights" region resident; the KV cache may stay released. DeepSeek-V3 / Kimi-K2: the fused
  q_a / kv_a projections travel in one bucket and an engine started from block-FP8 weights gets
  them quantized (`megarl.rollout.sglang.weights`).
- release_memory(tags) / resume_memory(tags): `release_memory_occupation(tags=...)` /
  `resume_memory_occupation(tags=...)` on the regions "kv_cache", "weights", "cuda_graph" (None:
  all), sending only the regions whose state changes (needs `enable_memory_saver=True`, which
  this class sets). After a resume of "weights" the weights are garbage unless
  `enable_weights_cpu_backup=True`: stream weights before the next generate. Colocated order
  (megarl.trainer.components): gradients and optimizer state off the GPU, resume_memory(["weights"])
  + update_weights from the trainer's weights, then the weights off and resume_memory() for
  generation, then release_memory() before the training state returns.

Semantics match the builtin engine (finish reasons, T-PPO window, FIRE as two generate calls,
`text` decoded from the response ids with skip_special_tokens=True). Differences: stop strings are
matched by SGLang on each call's own output text; log-probs are SGLang's (temperature applied,
before top-k / top-p renormalisation: srt/layers/sampler.py); `seed` reaches SGLang only through
the per-request seeds above. A checkpoint directory without tokenizer files starts SGLang with
skip_tokenizer_init=True (then SGLang refuses stop strings).

- routing replay (`return_routed_experts=True`, MoE models): the engine starts with
  `enable_return_routed_experts=True` and every generate call asks for `return_routed_experts`
  (unless its SamplingParams.return_routing is false: evaluation);
  SGLang answers `meta_info["routed_experts"]`, the experts of the request's first
  len(input) + len(output) - 1 tokens as base64 of int32 [tokens, layers, top_k] (older versions:
  a nested list; both are read). SGLang 0.5.23: srt/managers/scheduler_components/
  batch_result_processor.py `_maybe_collect_routed_experts` (positions 0 .. seqlen - 2, layers =
  the LM config's num_hidden_layers, k = num_experts_per_tok), srt/managers/detokenizer_manager.py
  `_b64_encode_per_request`. Each sample gets `routed_experts` [prompt + response, layers, top_k]
  from the call that produced its last tokens (FIRE's second call covers the first); the token
  SGLang never forwarded (the last) gets experts 0..k-1 (`torch_moe.sample_routing`).
"""

from __future__ import annotations

import base64
import collections
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megarl.weights.hf_reader import has_tokenizer, read_config
from megarl.rollout.sampling import segment_budget
from megarl.rollout.sglang.requests import (
    GenerateCall, ReleasedMemory, broadcast_from_owner, check_generate_request, engine_experts, engine_launch_env,
    gather_to_owner, lockstep,
    memory_tags, needs_weight_update_session, rebucket, request_seeds, run_on_owner, run_segment,
    with_last_flag)
from megarl.rollout.sglang.weights import fp8_names, keep_partners_together, quantized
from megarl.rollout.torch_moe import sample_routing
from megarl.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)


def _import_sglang():
    try:
        import sglang
    except ImportError as err:
        raise ImportError("rollout.engine=sglang needs the `sglang` package (pip install "
                          "'megarl[gpu]', sglang==0.5.23, on a CUDA machine)") from err
    return sglang


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class SGLangEngine:
    """RolloutEngine backed by `sglang.Engine`; see the module docstring.

    `start=True` starts the engine in the constructor. `sglang_module` stands in for the
    `sglang` package (anything with `Engine` and `__version__`).
    """

    def __init__(self, model_path: str | Path, *, group: dist.ProcessGroup | None = None,
                 tp_size: int | None = None, dtype: str = "bfloat16",
                 mem_fraction_static: float | None = None, base_gpu_id: int | None = None,
                 random_seed: int | None = None, load_format: str = "auto",
                 enable_weights_cpu_backup: bool = False, bucket_bytes: int = 512 << 20,
                 start: bool = False, sglang_module: Any = None, return_routed_experts: bool = False,
                 **server_kwargs: Any):
        self._sglang = sglang_module if sglang_module is not None else _import_sglang()
        self.sglang_version = self._sglang.__version__
        self.model_path = str(model_path)
        self.group = group
        group_size = dist.get_world_size(group) if group is not None else 1
        self.tp_size = tp_size or group_size
        if self.tp_size != group_size:
            raise ValueError(f"SGLangEngine: tp_size={self.tp_size} but the weight group has "
                             f"{group_size} ranks; colocation needs one rank per engine GPU")
        self.is_owner = group is None or dist.get_rank(group) == 0
        if server_kwargs.get("moe_a2a_backend") == "deepep" and not _has_module("deep_ep"):
            raise ImportError("rollout.sglang_server_args moe_a2a_backend=deepep needs DeepEP (the `deep_ep` "
                              "package, built with NVSHMEM; SGLang's docker images carry it): install it or drop "
                              "moe_a2a_backend (the planner then counts all-gathers: megarl plan)")
        self.nnodes = int(server_kwargs.get("nnodes", 1))
        if self.nnodes > 1 and group_size % self.nnodes:
            raise ValueError(f"SGLangEngine: nnodes={self.nnodes} does not divide the engine's {group_size} ranks")
        self.bucket_bytes = bucket_bytes
        self.cpu_backup = enable_weights_cpu_backup
        config = read_config(self.model_path)
        config = {**config, **(config.get("text_config") or {})}  # a vision-language model's LM settings
        self.max_context = int(server_kwargs.get("context_length")
                               or config.get("max_position_embeddings") or 0) or None
        self.vocab_size = int(config["vocab_size"])
        self.return_routed_experts = return_routed_experts
        if return_routed_experts:
            server_kwargs["enable_return_routed_experts"] = True
            self.routing_shape = (int(config["num_hidden_layers"]), int(config["num_experts_per_tok"]))
        self._routing: dict[tuple[int, ...], torch.Tensor] = {}  # full sequence -> experts, of this call
        self._want_routing = return_routed_experts  # this call asks for them (SamplingParams.return_routing)
        self.fp8 = fp8_names(self.model_path)  # (names stored block-FP8, block) or None
        self.load_format = load_format
        self.weights_valid = False
        self.weight_version = 0
        self.started = False
        self.memory = ReleasedMemory()
        tokenizer_files = has_tokenizer(self.model_path)
        server_kwargs.setdefault("skip_tokenizer_init", not tokenizer_files)
        self.engine_kwargs = dict(
            model_path=self.model_path, tp_size=self.tp_size, dtype=dtype,
            mem_fraction_static=mem_fraction_static, base_gpu_id=base_gpu_id,
            random_seed=random_seed, load_format=load_format, enable_memory_saver=True,
            enable_weights_cpu_backup=enable_weights_cpu_backup, **server_kwargs)
        self.tokenizer = None
        if self.is_owner and tokenizer_files:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._engine = self._node_engine = None
        ep = int(server_kwargs.get("ep_size", 1))
        experts = int(config.get("num_experts") or config.get("n_routed_experts") or 0)
        # the routed experts this rank's GPU hosts (SGLang expert parallelism); None: all of them
        self.hosted_experts = (engine_experts(dist.get_rank(group) if group is not None else 0, self.tp_size, ep, experts)
                               if ep > 1 else None)
        if start:
            self.start()

    def start(self) -> None:
        """Creates the SGLang engine with all its memory resident; a no-op once started.

        SGLang sizes the KV pool from the GPU memory free right now (mem_fraction_static;
        srt/mem_cache/kv_cache_configurator.py `_profile_available_bytes`): call it while the
        training state is off the GPU. An engine over several nodes (`nnodes` > 1: its group spans
        them, gpus per node = group size / nnodes) starts on every node's first rank at once:
        the owner as node 0 (tokenizer and detokenizer, the engine megarl drives), the others as
        node k with SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0 (srt/entrypoints/engine.py: their
        Engine() launches that node's schedulers and returns), all joining the owner's
        dist_init_addr; an error on any of them raises on every rank of the group.
        """
        if self.started:
            return
        if self.nnodes > 1:
            self._start_nodes()
        else:
            run_on_owner(self._create, self.group)
        self.started = True
        self.memory = ReleasedMemory()
        self.weights_valid = self.load_format != "dummy"

    def _start_nodes(self) -> None:
        rank, per_node = dist.get_rank(self.group), dist.get_world_size(self.group) // self.nnodes
        addr = broadcast_from_owner(owner_address() if self.is_owner else None, self.group)
        error = None
        if rank % per_node == 0:
            try:
                self._create(node_rank=rank // per_node, dist_init_addr=addr)
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                error = f"node {rank // per_node}: {err!r}"
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e]
        if failed:
            raise RuntimeError(f"SGLang engine over {self.nnodes} nodes did not start: {'; '.join(failed)}")

    def _create(self, **node) -> None:
        kwargs = dict(self.engine_kwargs, **node)
        if kwargs["base_gpu_id"] is None:
            kwargs["base_gpu_id"] = torch.cuda.current_device()
        if "NCCL_CUMEM_ENABLE" not in os.environ:
            log.warning("NCCL_CUMEM_ENABLE is not set: SGLang sets it to 0 in its own processes; "
                        "export NCCL_CUMEM_ENABLE=0 for every rank (launch/*.py do)")
        with engine_launch_env() as env:
            follower = node.get("node_rank", 0) >= 1  # this node's schedulers only; the owner's Engine drives them
            if follower:
                env["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
            try:
                engine = self._sglang.Engine(**kwargs)
            finally:
                if follower:
                    env.pop("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", None)
        if node.get("node_rank", 0) == 0:
            self._engine = engine
        else:
            self._node_engine = engine  # shut down with the engine

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 images: Sequence | None = None) -> list[Sample]:
        """images: vision-language models, one `PromptImages` (or None) per prompt; the prompts hold
        the expanded image pad tokens, as HF's processor writes them. On the owner only (module
        docstring): the samples stay there."""
        self._require_owner("generate")
        return self._generate(prompts, sampling, images)

    def continue_samples(self, samples: Sequence[Sample], sampling: SamplingParams) -> list[Sample]:
        self._require_owner("continue_samples")
        return self._continue(samples, sampling)

    def _require_owner(self, what: str) -> None:
        if not self.is_owner:
            raise RuntimeError(f"SGLangEngine.{what} runs on the engine's owner (group rank 0) only: the owner's "
                               "engine drives every GPU of the group, and the samples stay on the owner")

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                  images: Sequence | None = None) -> list[Sample]:
        self._check(sampling)
        self._want_routing = self.return_routed_experts and sampling.return_routing
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        prompts = [self._check_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if len(p) >= self._context():
                raise ValueError(f"prompt {i} has {len(p)} tokens; the engine context is "
                                 f"{self._context()} tokens")
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        seeds = request_seeds(sampling.seed, [(i, j) for i in range(len(prompts))
                                              for j in range(sampling.n)])
        budgets = [segment_budget(len(p), 0, sampling, self._context()) for _, p in rows]
        self._routing.clear()
        row_images = None if images is None else [images[i] for i, _ in rows]
        segments = self._segments([p for _, p in rows], budgets, sampling, True, seeds, row_images)
        return [Sample(prompt_ids=list(p), response_ids=ids, logprobs=lps, finish_reason=reason,
                       text=self._decode(ids), index=i, images=None if images is None else images[i],
                       meta={"weight_versions": [self.weight_version]}, routed_experts=self._routed(p + ids))
                for (i, p), (ids, lps, reason) in zip(rows, segments)]

    def _continue(self, samples: Sequence[Sample], sampling: SamplingParams) -> list[Sample]:
        self._check(sampling)
        self._want_routing = self.return_routed_experts and sampling.return_routing
        if sampling.n != 1:
            raise ValueError(f"continue_samples: SamplingParams.n must be 1 (got {sampling.n})")
        contexts, budgets, todo, keys = [], [], [], []
        for k, s in enumerate(samples):
            if s.finish_reason != "truncated":
                raise ValueError(f"continue_samples: sample {k} has finish_reason "
                                 f"{s.finish_reason!r}; only 'truncated' samples can be continued")
            context = (self._check_ids(s.prompt_ids, f"sample {k} prompt_ids")
                       + self._check_ids(s.response_ids, f"sample {k} response_ids", True))
            budget = segment_budget(len(context), len(s.response_ids), sampling, self._context())
            if budget[0] > 0:
                contexts.append(context)
                budgets.append(budget)
                todo.append(k)
                keys.append((s.index, k))
        seeds = request_seeds(sampling.seed, keys, stream="continue")
        self._routing.clear()
        segments = dict(zip(todo, self._segments(contexts, budgets, sampling, False, seeds,
                                                 [samples[k].images for k in todo])))
        out = []
        for k, s in enumerate(samples):
            ids, lps, reason = segments.get(k, ([], [], "length"))
            response = list(s.response_ids) + ids
            meta = dict(s.meta)
            meta["weight_versions"] = list(meta.get("weight_versions", [])) + [self.weight_version]
            out.append(Sample(prompt_ids=list(s.prompt_ids), response_ids=response,
                              logprobs=list(s.logprobs) + lps, finish_reason=reason,
                              text=self._decode(response), index=s.index, meta=meta, images=s.images,
                              routed_experts=self._routed(list(s.prompt_ids) + response) if ids else None))
        return out

    def _segments(self, contexts, budgets, sampling, fire, seeds, images=None):
        if not contexts:
            return []
        return run_segment(self._call, contexts, [b for b, _ in budgets],
                           [w for _, w in budgets], sampling, fire, seeds, images)

    def _call(self, call: GenerateCall) -> list[dict]:
        extra = {"return_routed_experts": True} if self._want_routing else {}
        if call.images is not None:
            if any(im is not None and im.pixel_values is not None for im in call.images):
                extra["image_data"] = image_data(call.images)
            if any(im is not None and im.pixel_values_videos is not None for im in call.images):
                extra["video_data"] = video_data(call.images)
        check_generate_request(call.input_ids, call.sampling_params, extra.get("image_data"), extra.get("video_data"))
        outputs = self._engine.generate(input_ids=call.input_ids,
                                        sampling_params=call.sampling_params, return_logprob=True, **extra)
        outputs = outputs if isinstance(outputs, list) else [outputs]
        if len(outputs) != len(call.input_ids):
            raise RuntimeError(f"SGLang answered {len(outputs)} outputs for {len(call.input_ids)} requests")
        if self._want_routing:
            for ids, out in zip(call.input_ids, outputs):
                full = list(ids) + [int(e[1]) for e in out["meta_info"]["output_token_logprobs"]]
                self._routing[tuple(full)] = decode_routed_experts(
                    out["meta_info"].get("routed_experts"), len(full) - 1, self.routing_shape)
        return outputs

    def _routed(self, sequence: list[int]) -> torch.Tensor | None:
        """[len(sequence), layers, k] experts of a generated sequence (None without routing replay)."""
        if not self._want_routing:
            return None
        rec = self._routing.get(tuple(sequence))
        if rec is None:
            raise RuntimeError(f"SGLang returned no routed_experts for a sequence of {len(sequence)} tokens")
        return sample_routing(rec, [], len(sequence))

    def _check(self, sampling: SamplingParams) -> None:
        sampling.validate()
        if not self.started or self.memory.tags:
            raise RuntimeError("SGLang engine memory is released (or the engine is not started); "
                               "call resume_memory() before generating")
        if not self.weights_valid:
            raise RuntimeError("SGLang weights are not valid (load_format='dummy' or memory was "
                               "resumed without a CPU backup); call update_weights() first")

    def _check_ids(self, ids: Sequence[int], what: str, allow_empty: bool = False) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids and not allow_empty:
            raise ValueError(f"{what} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _context(self) -> int:
        if self.max_context is None:
            self.max_context = int(self._engine.tokenizer_manager.context_len)
        return self.max_context

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, stream: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Collective over `group`: every rank passes its own stream (same names and buckets).

        After each bucket the owner broadcasts its status, so an SGLang failure raises on every
        rank instead of leaving the others blocked in the next gather; this also guarantees that
        a rank's bucket tensors outlive the owner's load of them.
        """
        self._check_weights_resident()
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        monkey_patch_torch_reductions()
        session = needs_weight_update_session(self.sglang_version)
        if session:
            run_on_owner(lambda: self._ok(self._engine.begin_weight_update(selector="all"),
                                          "begin_weight_update"), self.group)
        device = torch.device("cuda", torch.cuda.current_device())
        keep_alive: collections.deque = collections.deque(maxlen=2)
        if self.fp8 is not None:  # an engine started from block-FP8 weights gets FP8 weights
            stream = quantized(stream, *self.fp8)
        mine = with_last_flag(keep_partners_together(rebucket(stream, self.bucket_bytes)))
        for bucket, more in lockstep(mine, self.group):  # ranks may hold different experts: equal rounds
            named = [(name, t.to(device, non_blocking=True).contiguous()) for name, t in bucket]
            if named:
                flat = FlattenedTensorBucket(named_tensors=named)
                tensor, metadata = flat.get_flattened_tensor(), flat.get_metadata()
            else:  # this rank's GPU loads nothing this round
                flat, tensor, metadata = None, torch.empty(0, dtype=torch.uint8, device=device), []
            keep_alive.append((named, flat, tensor))
            payload = MultiprocessingSerializer.serialize({"flattened_tensor": tensor, "metadata": metadata},
                                                          output_str=True)
            torch.cuda.current_stream().synchronize()  # the receiver reads after this returns
            payloads = gather_to_owner(payload, self.group)
            run_on_owner(lambda: self._ok(self._engine.update_weights_from_tensor(
                named_tensors=payloads, load_format="flattened_bucket", flush_cache=not more),
                "update_weights_from_tensor"), self.group)
        if session:
            run_on_owner(lambda: self._ok(self._engine.end_weight_update(), "end_weight_update"),
                         self.group)
        torch.cuda.synchronize()
        keep_alive.clear()
        self.weights_valid = True
        self.weight_version += 1

    def _check_weights_resident(self) -> None:
        if not self.started:
            raise RuntimeError("SGLangEngine.update_weights: the engine is not started; call start() "
                               "(or resume_memory()) first, with the training state off the GPU")
        if "weights" in self.memory.tags:
            raise RuntimeError("SGLangEngine.update_weights: the weights memory is released; call "
                               "resume_memory(['weights']) first")

    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Frees the engine's GPU memory regions `tags` (None: all); released ones are skipped.

        Nothing to free before the engine is started.
        """
        todo = self.memory.to_release(tags) if self.started else []
        if todo:
            run_on_owner(lambda: self._engine.release_memory_occupation(tags=todo), self.group)
            self.memory.released(todo)

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Takes the memory regions `tags` (None: all) back; resident ones are skipped.

        Starts the engine on first use (with only `tags` left resident): call it with the
        training state off the GPU. After "weights" come back the weights are garbage unless
        enable_weights_cpu_backup: stream them before the next generate.
        """
        wanted = memory_tags(tags)
        if not self.started:
            self.start()
            self.release_memory([t for t in self.memory.to_release() if t not in wanted])
            return
        todo = self.memory.to_resume(wanted)
        if todo:
            run_on_owner(lambda: self._engine.resume_memory_occupation(tags=todo), self.group)
            self.memory.resumed(todo)
            if "weights" in todo and not self.cpu_backup:
                self.weights_valid = False

    def shutdown(self) -> None:
        """Stops the engine (owner); `start()` or `resume_memory()` would start a new one."""
        for engine in (self._engine, self._node_engine):
            if engine is not None:
                engine.shutdown()
        self._engine = self._node_engine = None
        self.started = False
        self.weights_valid = False

    @staticmethod
    def _ok(result: Any, what: str) -> None:
        """SGLang control calls answer (success, message) (or a dict with those keys)."""
        if isinstance(result, dict):
            success, message = result.get("success", True), result.get("message", "")
        elif isinstance(result, (tuple, list)) and result:
            success, message = result[0], result[1] if len(result) > 1 else ""
        else:
            return
        if not success:
            raise RuntimeError(f"SGLang {what} failed: {message}")


def owner_address() -> str:
    """host:port an engine's nodes join (SGLang's dist_init_addr): this host's address and a free port."""
    import socket

    from megarl.parallel.launch import free_port

    return f"{socket.gethostbyname(socket.gethostname())}:{free_port()}"


def decode_routed_experts(value: Any, tokens: int, shape: tuple[int, int]) -> torch.Tensor:
    """SGLang's `meta_info["routed_experts"]` -> [tokens, layers, top_k] int16: base64 of int32
    (current SGLang) or a nested list (older versions)."""
    import numpy as np

    if value is None:
        raise RuntimeError("SGLang output has no meta_info.routed_experts: start the engine with "
                           "enable_return_routed_experts=True (algorithm.routing_replay)")
    if isinstance(value, str):
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(value), dtype=np.int32).copy())
    else:
        flat = torch.as_tensor(value, dtype=torch.int32)
    layers, k = shape
    if flat.numel() != tokens * layers * k:
        raise ValueError(f"SGLang routed_experts has {flat.numel()} entries, expected {tokens} tokens x "
                         f"{layers} layers x top-{k}")
    return flat.reshape(tokens, layers, k).to(torch.int16)


def image_data(images: Sequence) -> list:
    """SGLang's `image_data` for requests whose input ids already hold the expanded image pads: per
    request a list, with one HF processor-output item (`format="processor_output"`: pixel_values
    and image_grid_thw of all its images), empty for a text request. Every entry is a list, never
    None: SGLang keeps the entries per request only when the first one is a list
    (`check_generate_request`)."""
    return [[] if im is None or im.pixel_values is None else
            [{"format": "processor_output", "pixel_values": im.pixel_values, "image_grid_thw": im.image_grid_thw}]
            for im in images]


def video_data(images: Sequence) -> list:
    """SGLang's `video_data`, the same contract as `image_data` for the requests' videos: per
    request a list, with one processor-output item (pixel_values_videos, video_grid_thw and, for
    Qwen2.5-VL, second_per_grid_ts of all its videos), empty for a request without videos."""
    return [[] if im is None or im.pixel_values_videos is None else
            [{"format": "processor_output", **im.video_fields()}] for im in images]
