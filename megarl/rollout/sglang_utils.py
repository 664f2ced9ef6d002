"""Pure logic of the SGLang engine: request dicts, output parsing, weight buckets, gathering.

Nothing here imports sglang, so all of it is tested on CPU. Formats follow SGLang 0.5.23
(shared/reference/sglang.md §2-3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from megarl.rollout.sampling import TokenSampler, token_samplers
from megarl.rollout.types import FinishReason, SamplingParams

T = TypeVar("T")
Bucket = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------- requests


def sampling_dict(sampler: TokenSampler, sampling: SamplingParams, max_new_tokens: int) -> dict:
    """One SGLang `sampling_params` dict (n is always 1: the engine repeats prompts itself).

    top_k <= 0 maps to -1 (whole vocabulary); temperature 0 is greedy in SGLang as well.
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
    if sampling.seed is not None:
        params["sampling_seed"] = int(sampling.seed)
    return params


@dataclass(frozen=True)
class GenerateCall:
    """One `Engine.generate` call: per-request input ids and sampling dicts (same length)."""

    input_ids: list[list[int]]
    sampling_params: list[dict]


def first_call(contexts: Sequence[list[int]], budgets: Sequence[int], sampling: SamplingParams,
               fire: bool) -> GenerateCall:
    """The first generate call of a segment.

    FIRE (ALGORITHMS.md §9) splits generation into two calls: this one draws exactly one token
    with the first-token sampler (`token_samplers`: FIRE fields set last), `second_call` draws the
    rest with the regular sampler. Without FIRE this single call draws the whole budget.
    """
    first, regular = token_samplers(sampling)
    if fire and sampling.fire:
        dicts = [sampling_dict(first, sampling, 1) for _ in contexts]
    else:
        dicts = [sampling_dict(regular, sampling, b) for b in budgets]
    return GenerateCall([list(c) for c in contexts], dicts)


def second_call(contexts: Sequence[list[int]], first_tokens: Sequence[int],
                remaining: Sequence[int], sampling: SamplingParams) -> GenerateCall:
    """FIRE's second call: context + first token, regular sampler, the remaining budget."""
    regular = token_samplers(sampling)[1]
    return GenerateCall([list(c) + [int(t)] for c, t in zip(contexts, first_tokens)],
                        [sampling_dict(regular, sampling, r) for r in remaining])


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


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.5.23.post1' -> (0, 5, 23); '0.5.21rc1' -> (0, 5, 21)."""
    match = re.match(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"cannot parse version string {version!r}")
    return tuple(int(g) for g in match.groups() if g is not None)


def needs_weight_update_session(version: str) -> bool:
    """SGLang >= 0.5.21 requires begin_weight_update()/end_weight_update() around updates."""
    return version_tuple(version) >= (0, 5, 21)


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


def run_on_owner(fn: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """Runs `fn` on the group's rank 0 and returns its result on every rank of `group`.

    An exception on the owner is re-raised on every rank (the other ranks would otherwise wait
    forever in the next collective).
    """
    result, error = None, None
    if group is None or dist.get_rank(group) == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - forwarded to every rank below
            error = err
    result, error = broadcast_from_owner((result, error), group)
    if error is not None:
        raise error
    return result  # type: ignore[return-value]


# ---------------------------------------------------------------------------- one segment

Segment = tuple[list[int], list[float], FinishReason]


def run_segment(call: Callable[[GenerateCall], list[dict]], contexts: Sequence[list[int]],
                budgets: Sequence[int], window_limited: Sequence[bool], sampling: SamplingParams,
                fire: bool) -> list[Segment]:
    """Generates one segment per context through `call` (SGLang `Engine.generate` in production).

    Without FIRE: one call. With FIRE (`fire` and `sampling.fire`): a 1-token call at the FIRE
    sampler, then a call with the regular sampler for the remaining budget on the contexts whose
    first token did not stop them; results are concatenated per context.
    """
    outputs = call(first_call(contexts, budgets, sampling, fire))
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
                                [budgets[i] - 1 for i in pending], sampling))
        if len(rest) != len(pending):
            raise ValueError(f"SGLang returned {len(rest)} outputs for {len(pending)} requests")
        for i, output in zip(pending, rest):
            ids, logprobs, reason = parse_output(output, window_limited[i])
            results[i] = (firsts[i][0] + ids, firsts[i][1] + logprobs, reason)
    return results  # type: ignore[return-value]
