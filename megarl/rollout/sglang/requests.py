"""Pure logic of the SGLang engine: request dicts, output parsing, weight buckets, gathering.

Nothing here imports sglang, so all of it is tested on CPU. Formats follow SGLang 0.5.23, read
against its source.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, MutableMapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from megarl.rollout.sampling import TokenSampler, token_samplers
from megarl.rollout.types import FinishReason, SamplingParams

T = TypeVar("T")
Bucket = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------- requests


def sampling_dict(sampler: TokenSampler, sampling: SamplingParams, max_new_tokens: int,
                  seed: int | None = None) -> dict:
    """One SGLang `sampling_params` dict (n is always 1: the engine repeats prompts itself).

    top_k <= 0 maps to -1 (whole vocabulary); temperature 0 is greedy in SGLang as well.
    `seed` is this request's own `sampling_seed` (see `sample_seed`), not `sampling.seed`.
    """
    params = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(sampler.temperature),
        "top_p": float(sampler.top_p),
        "top_k": int(sampler.top_k) if sampler.top_k > 0 else -1,
        "n": 1,
        "skip_special_tokens": True,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def sample_seed(seed: int, prompt: int, sample: int, stream: str = "generate") -> int:
    """The `sampling_seed` of one request: a reproducible hash in [0, 2**63) of its keys.

    Under deterministic inference SGLang draws every token from hash(sampling_seed, position)
    (srt/layers/sampler.py `multinomial_with_seed`), so requests that share a context and a seed
    share their tokens: the n samples of a prompt each need their own seed. `stream` separates
    the seeds of different kinds of call ("generate", "continue") made with one call seed.
    """
    key = f"{int(seed)}:{stream}:{int(prompt)}:{int(sample)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def request_seeds(seed: int | None, keys: Sequence[tuple[int, int]], stream: str = "generate") -> list[int]:
    """`sample_seed` of each (prompt index, sample index); a fresh random call seed when None."""
    base = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
    return [sample_seed(base, prompt, sample, stream) for prompt, sample in keys]


@dataclass(frozen=True)
class GenerateCall:
    """One `Engine.generate` call: per-request input ids and sampling dicts (same length), and for
    vision-language models each request's images (`PromptImages` or None; None for all text)."""

    input_ids: list[list[int]]
    sampling_params: list[dict]
    images: list | None = None


def _request_images(images: Sequence | None) -> list | None:
    return list(images) if images is not None and any(im is not None for im in images) else None


def first_call(contexts: Sequence[list[int]], budgets: Sequence[int], sampling: SamplingParams,
               fire: bool, seeds: Sequence[int | None] | None = None, images: Sequence | None = None) -> GenerateCall:
    """The first generate call of a segment (`seeds`: one `sampling_seed` per context, or None).

    FIRE (docs/algorithms.md §9) splits generation into two calls: this one draws exactly one token
    with the first-token sampler (`token_samplers`: FIRE fields set last), `second_call` draws the
    rest with the regular sampler. Without FIRE this single call draws the whole budget.
    """
    seeds = _per_request(seeds, len(contexts))
    first, regular = token_samplers(sampling)
    if fire and sampling.fire:
        dicts = [sampling_dict(first, sampling, 1, s) for s in seeds]
    else:
        dicts = [sampling_dict(regular, sampling, b, s) for b, s in zip(budgets, seeds)]
    return GenerateCall([list(c) for c in contexts], dicts, _request_images(images))


def second_call(contexts: Sequence[list[int]], first_tokens: Sequence[int],
                remaining: Sequence[int], sampling: SamplingParams,
                seeds: Sequence[int | None] | None = None, images: Sequence | None = None) -> GenerateCall:
    """FIRE's second call: context + first token, regular sampler, the remaining budget.

    A request keeps its first call's seed: its positions differ from the first call's, and
    SGLang's seeded draw depends on (seed, position).
    """
    regular = token_samplers(sampling)[1]
    seeds = _per_request(seeds, len(contexts))
    return GenerateCall([list(c) + [int(t)] for c, t in zip(contexts, first_tokens)],
                        [sampling_dict(regular, sampling, r, s) for r, s in zip(remaining, seeds)],
                        _request_images(images))


def _per_request(seeds: Sequence[int | None] | None, n: int) -> list[int | None]:
    if seeds is None:
        return [None] * n
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} requests")
    return list(seeds)


def check_generate_request(input_ids: Any, sampling_params: Any, image_data: Any = None,
                           video_data: Any = None) -> None:
    """Raises ValueError unless an `Engine.generate` call is in the shape SGLang reads per request.

    - input_ids: a list of non-empty token-id lists (a batch; flat ids would be one request),
      with one sampling dict per request (only the structure is checked: O(requests));
    - image_data: None, or one list per request: empty for a text request, else exactly one
      {"format": "processor_output", ...} dict. SGLang keeps per-request lists only when the FIRST
      entry is a list and otherwise wraps every entry again (srt/managers/io_struct.py,
      GenerateReqInput._normalize_image_data), so a None entry first hides the next requests'
      items; and a processor-output item must be its request's only one
      (srt/multimodal/processors/base_processor.py, _validate_one_modality);
    - video_data: the same rules (one processor-output item holds all of a request's videos).
    """
    if not isinstance(input_ids, list) or not all(isinstance(ids, list) and ids for ids in input_ids):
        raise ValueError("SGLang request: input_ids must be a list of non-empty token-id lists")
    if not isinstance(sampling_params, list) or len(sampling_params) != len(input_ids) \
            or not all(isinstance(d, dict) for d in sampling_params):
        raise ValueError(f"SGLang request: one sampling dict per request ({len(input_ids)} requests)")
    for what, data in (("image_data", image_data), ("video_data", video_data)):
        if data is None:
            continue
        if not isinstance(data, list) or len(data) != len(input_ids):
            raise ValueError(f"SGLang request: {what} must hold one entry per request ({len(input_ids)})")
        for i, items in enumerate(data):
            if not isinstance(items, list) or len(items) > 1:
                raise ValueError(f"SGLang request: {what}[{i}] must be a list of at most one item "
                                 f"(got {type(items).__name__})")
            if items and not (isinstance(items[0], dict) and items[0].get("format") == "processor_output"):
                raise ValueError(f"SGLang request: {what}[{i}] holds a {type(items[0]).__name__}, "
                                 "not a processor_output dict")


# ---------------------------------------------------------------------------- outputs


def map_finish_reason(finish_reason: dict | None, window_limited: bool) -> FinishReason:
    """SGLang `meta_info["finish_reason"]` dict -> "stop" | "length" | "truncated".

    {"type": "stop", "matched": ...} -> "stop"; {"type": "length", ...} -> "truncated" when the
    T-PPO window set max_new_tokens, else "length"; {"type": "abort", "message": ...} raises.
    """
    if not isinstance(finish_reason, dict):
        raise ValueError(f"SGLang output has no finish_reason dict (got {finish_reason!r}); "
                         "the request did not finish")
    kind = finish_reason.get("type")
    if kind == "stop":
        return "stop"
    if kind == "length":
        return "truncated" if window_limited else "length"
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted the request: {finish_reason.get('message')}")
    raise ValueError(f"SGLang finish_reason has unknown type {kind!r}: {finish_reason}")


def parse_output(output: dict, window_limited: bool) -> tuple[list[int], list[float], FinishReason]:
    """(response ids, per-token log-probs, finish reason) of one SGLang output dict.

    Ids and log-probs come from `meta_info["output_token_logprobs"]`, a list of
    `(logprob, token_id, text_or_None)` (tuples in-process, JSON arrays over HTTP).
    """
    meta = output.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise ValueError("SGLang output has no meta_info.output_token_logprobs; "
                         "call generate with return_logprob=True")
    entries = meta["output_token_logprobs"]
    ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    if "output_ids" in output and len(output["output_ids"]) != len(ids):
        raise ValueError(f"SGLang output has {len(output['output_ids'])} output_ids but "
                         f"{len(ids)} output_token_logprobs")
    return ids, logprobs, map_finish_reason(meta.get("finish_reason"), window_limited)


# ---------------------------------------------------------------------------- weight buckets


def plan_buckets(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Greedy split of (name, nbytes) in order into buckets of at most `max_bytes` each.

    A tensor larger than `max_bytes` gets a bucket of its own; order is preserved.
    """
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes (got {max_bytes})")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def rebucket(stream: Iterable[Bucket], max_bytes: int) -> Iterator[Bucket]:
    """Re-splits a weight stream into single-dtype buckets of at most `max_bytes` each.

    Each incoming bucket is split on its own (tensors never wait for a later bucket), so memory
    stays bounded by one incoming bucket plus one outgoing one.
    """
    for bucket in stream:
        by_dtype: dict[torch.dtype, Bucket] = {}
        for name, tensor in bucket:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        for group in by_dtype.values():
            tensors = dict(group)
            sizes = [(n, t.numel() * t.element_size()) for n, t in group]
            for names in plan_buckets(sizes, max_bytes):
                yield [(n, tensors[n]) for n in names]


def with_last_flag(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yields (item, is_last) with one item of look-ahead (flush the cache only on the last)."""
    iterator = iter(items)
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


def lockstep(buckets: Iterable[tuple[Bucket, bool]], group: dist.ProcessGroup | None) -> Iterator[tuple[Bucket, bool]]:
    """Rounds of (this rank's bucket, whether any rank of `group` has more after this round) from a
    per-rank `with_last_flag` stream: every rank goes through the same number of rounds (a rank
    whose own stream is shorter gets empty buckets), so per-round collectives line up even when
    ranks receive different tensors (an engine with expert parallelism). Collective over `group`."""
    it = iter(buckets)
    while True:
        item = next(it, None)
        bucket, last = item if item is not None else ([], True)
        if group is None or dist.get_world_size(group) == 1:
            if item is None:
                return
            yield bucket, not last
            continue
        states = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, (item is not None, not last), group=group)
        if not any(has for has, _ in states):
            return
        yield bucket, any(more for _, more in states)


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.5.23.post1' -> (0, 5, 23); '0.5.21rc1' -> (0, 5, 21)."""
    match = re.match(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"cannot parse version string {version!r}")
    return tuple(int(g) for g in match.groups() if g is not None)


def needs_weight_update_session(version: str) -> bool:
    """SGLang >= 0.5.21 requires begin_weight_update()/end_weight_update() around updates."""
    return version_tuple(version) >= (0, 5, 21)


# ---------------------------------------------------------------------------- engine lifecycle


def server_args(cfg: Any) -> dict[str, Any]:
    """`sglang.Engine` keyword arguments (ServerArgs fields) from a `MegaRLConfig`.

    tp_size = parallel.rollout_tp, mem_fraction_static = rollout.mem_fraction, with rollout.sglang_dp_size
    > 1 enable_dp_attention and dp_size, ep_size = rollout.sglang_ep_size when > 1, nnodes when the engine
    spans nodes (parallel.rollout_tp > gpus_per_node),
    context_length = rollout.sglang_context_length, or when null
        data.max_prompt_len + max(rollout.max_new_tokens, eval.max_new_tokens)
    (the longest request the engine serves; generation budgets are capped by it, and SGLang
    refuses a context_length above the model's max_position_embeddings unless the environment
    sets SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1), chunked_prefill_size =
    rollout.sglang_chunked_prefill_size, left out when null so SGLang picks its GPU-dependent default,
    and rollout.sglang_server_args (any other ServerArgs field; the config refuses the ones above).
    """
    r, p = cfg.rollout, cfg.parallel
    context = r.sglang_context_length or cfg.data.max_prompt_len + max(r.max_new_tokens, cfg.eval.max_new_tokens)
    args: dict[str, Any] = {"tp_size": p.rollout_tp, "mem_fraction_static": r.mem_fraction,
                            "context_length": int(context)}
    if r.sglang_chunked_prefill_size is not None:
        args["chunked_prefill_size"] = int(r.sglang_chunked_prefill_size)
    if r.sglang_dp_size > 1:  # attention data parallelism: srt/layers/dp_attention.py
        args.update(enable_dp_attention=True, dp_size=int(r.sglang_dp_size))
    if r.sglang_ep_size > 1:
        args["ep_size"] = int(r.sglang_ep_size)
    if p.rollout_tp > p.gpus_per_node:  # an engine over whole nodes; node_rank / dist_init_addr come at start
        args["nnodes"] = p.rollout_tp // p.gpus_per_node
    return {**dict(r.sglang_server_args), **args}


def engine_experts(tp_rank: int, tp_size: int, ep_size: int, num_experts: int) -> range:
    """The routed experts SGLang's GPU `tp_rank` of an engine of `tp_size` GPUs holds with ep_size:
    its MoE EP rank is tp_rank // (tp_size // ep_size) (moe_tp_size GPUs share an EP rank and split
    its experts' weights), and EP rank r holds experts r * E / ep_size .. (r + 1) * E / ep_size - 1
    (SGLang's FusedMoE; its weight loader skips the other experts)."""
    if tp_size % ep_size or num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the engine's {tp_size} GPUs and its {num_experts} experts")
    ep_rank, per = tp_rank // (tp_size // ep_size), num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


# srt/constants.py GPU_MEMORY_ALL_TYPES: the regions release/resume_memory_occupation take as tags
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
# what Engine() rewrites in the calling process (srt/entrypoints/engine.py _set_envs_and_config; 0.5.17
# also sets CUDA_MODULE_LOADING, 0.5.23 no longer does)
ENGINE_REWRITTEN_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "CUDA_MODULE_LOADING")


def memory_tags(tags: Iterable[str] | None) -> list[str]:
    """Validated tags in `MEMORY_TAGS` order; None means all of them."""
    if tags is None:
        return list(MEMORY_TAGS)
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown SGLang memory tags {unknown} (choose from {list(MEMORY_TAGS)})")
    return [t for t in MEMORY_TAGS if t in tags]


class ReleasedMemory:
    """Which SGLang memory regions are released.

    Each release / resume must send only the tags whose state changes: SGLang's resume of a tag
    that is not released fails (`offload_tags.remove(tag)` in
    srt/managers/scheduler_components/weight_updater.py), and a second release would pause the
    torch_memory_saver region twice.
    """

    def __init__(self) -> None:
        self.tags: set[str] = set()

    def to_release(self, tags: Iterable[str] | None = None) -> list[str]:
        return [t for t in memory_tags(tags) if t not in self.tags]

    def to_resume(self, tags: Iterable[str] | None = None) -> list[str]:
        return [t for t in memory_tags(tags) if t in self.tags]

    def released(self, tags: Iterable[str]) -> None:
        self.tags.update(tags)

    def resumed(self, tags: Iterable[str]) -> None:
        self.tags.difference_update(tags)


@contextlib.contextmanager
def engine_launch_env(environ: MutableMapping[str, str] | None = None) -> Iterator[MutableMapping[str, str]]:
    """The process environment while `sglang.Engine(...)` starts in a torchrun worker.

    - torchrun exports TORCHELASTIC_USE_AGENT_STORE=True to its workers. The scheduler
      subprocesses Engine() spawns inherit it and then join their own tcp:// rendezvous as
      TCPStore clients only, with nobody hosting the store (torch/distributed/rendezvous.py
      `_create_c10d_store`), and wait out the whole timeout. It is removed for the duration.
    - Engine() rewrites CUDA_DEVICE_MAX_CONNECTIONS, NCCL_CUMEM_ENABLE and NCCL_NVLS_ENABLE in the
      calling process. The training process gets its own values back afterwards, so the NCCL
      communicators it creates later match those of the ranks that own no engine.
    """
    environ = os.environ if environ is None else environ
    saved = {key: environ.get(key) for key in (AGENT_STORE_ENV, *ENGINE_REWRITTEN_ENV)}
    environ.pop(AGENT_STORE_ENV, None)
    try:
        yield environ
    finally:
        for key, value in saved.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value


# ---------------------------------------------------------------------------- distributed


def gather_to_owner(payload: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Gathers one picklable payload per rank of `group` to the group's rank 0 (the engine owner).

    Returns the list ordered by group rank on the owner, None elsewhere. Use a gloo group: the
    payloads are small (serialized CUDA-IPC handles), and objects travel through CPU.
    No group (or a group of one) means a single-rank engine: returns [payload].
    """
    if group is None or dist.get_world_size(group) == 1:
        return [payload]
    is_owner = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_owner else None
    dist.gather_object(payload, gathered, group=group, group_dst=0)
    return gathered


def broadcast_from_owner(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Sends the owner's `obj` to every rank of `group` (returns it everywhere)."""
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def run_on_owner(fn: Callable[[], T], group: dist.ProcessGroup | None, share_result: bool = True) -> T | None:
    """Runs `fn` on the group's rank 0 and returns its result on every rank of `group` (with
    share_result=False only on the owner: the other ranks get None and learn only whether it
    succeeded, so a large result never travels).

    An exception on the owner is re-raised on every rank (the other ranks would otherwise wait
    forever in the next collective).
    """
    result, error = None, None
    owner = group is None or dist.get_rank(group) == 0
    if owner:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - forwarded to every rank below
            error = err
    shared, error = broadcast_from_owner((result if share_result else None, error), group)
    if error is not None:
        raise error
    return result if owner else shared  # type: ignore[return-value]


# ---------------------------------------------------------------------------- one segment

Segment = tuple[list[int], list[float], FinishReason]


def run_segment(call: Callable[[GenerateCall], list[dict]], contexts: Sequence[list[int]],
                budgets: Sequence[int], window_limited: Sequence[bool], sampling: SamplingParams,
                fire: bool, seeds: Sequence[int | None] | None = None, images: Sequence | None = None) -> list[Segment]:
    """Generates one segment per context through `call` (SGLang `Engine.generate` in production).

    Without FIRE: one call. With FIRE (`fire` and `sampling.fire`): a 1-token call at the FIRE
    sampler, then a call with the regular sampler for the remaining budget on the contexts whose
    first token did not stop them; results are concatenated per context. `seeds`: one
    `sampling_seed` per context (None: no seed sent). `images`: one PromptImages or None per
    context (vision-language models), sent with both calls.
    """
    seeds = _per_request(seeds, len(contexts))
    outputs = call(first_call(contexts, budgets, sampling, fire, seeds, images))
    if len(outputs) != len(contexts):
        raise ValueError(f"SGLang returned {len(outputs)} outputs for {len(contexts)} requests")
    if not (fire and sampling.fire):
        return [parse_output(o, wl) for o, wl in zip(outputs, window_limited)]
    results: list[Segment | None] = [None] * len(contexts)
    firsts: list[tuple[list[int], list[float]]] = []
    pending = []
    for i, output in enumerate(outputs):
        ids, logprobs, reason = parse_output(output, window_limited=False)
        if len(ids) != 1:
            raise ValueError(f"FIRE first call returned {len(ids)} tokens for request {i}, expected 1")
        firsts.append((ids, logprobs))
        if reason == "stop":
            results[i] = (ids, logprobs, "stop")
        elif budgets[i] == 1:
            results[i] = (ids, logprobs, "truncated" if window_limited[i] else "length")
        else:
            pending.append(i)
    if pending:
        rest = call(second_call([contexts[i] for i in pending], [firsts[i][0][0] for i in pending],
                                [budgets[i] - 1 for i in pending], sampling,
                                [seeds[i] for i in pending], None if images is None else [images[i] for i in pending]))
        if len(rest) != len(pending):
            raise ValueError(f"SGLang returned {len(rest)} outputs for {len(pending)} requests")
        for i, output in zip(pending, rest):
            ids, logprobs, reason = parse_output(output, window_limited[i])
            results[i] = (firsts[i][0] + ids, firsts[i][1] + logprobs, reason)
    return results  # type: ignore[return-value]
