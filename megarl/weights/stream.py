"""Stream full, HF-named tensors out of any TP/PP/VPP/EP Megatron layout, in bounded buckets.

This is the weights contract (docs/design.md, "Contracts"): the HF exporter, the builtin engine and the SGLang
engine all consume `stream_hf_weights(...)`, an iterator of buckets `[(hf_name, tensor), ...]`.

How a bucket is made (every rank runs the same plan, so collectives line up):
1. Once per call, each pipeline stage's tensor list (HF names, HF shapes, dtype, TP layout) is
   all-gathered over the PP group; every rank then cuts the same buckets of at most
   `bucket_bytes` (a bigger single tensor gets a bucket of its own), each owned by one stage. A
   routed expert's tensors are one entry per expert (layer l, global expert e), in HF order
   (expert 0's, then expert 1's, ...), not one expert slot times the EP size.
2. Dense tensors, on the owning stage: the TP-sharded parameters of the bucket are packed into
   one byte buffer and all-gathered over the TP group, then merged into HF tensors (fused QKV
   split into q/k/v, gated fc1 into gate/up, vocab padding cut); replicated parameters are taken
   locally. Where HF keeps all experts of a layer in one tensor (`ParamMap.hf_expert`,
   qwen3_vl_moe) that tensor is assembled whole (the EP ranks' parts concatenated in rank
   order): it is one HF tensor, bounded like any single tensor by its own size.
3. Routed experts: the ranks that hold a bucket's experts (their EP rank on the owning stage)
   gather each one's expert-TP shards and merge them; then each expert goes point to point, only
   to the ranks that want it (`want_expert`; megarl.weights.expert_delivery), whatever stage they
   are on. So no buffer is larger than a bucket, whatever the EP size, and a rank receives only
   the experts its engine hosts.
4. With PP > 1 the owning stage packs the bucket's dense tensors into one byte buffer and
   broadcasts it over the PP group; the other stages receive it. The yielded tensors are views
   into that buffer.

Memory: while a bucket is assembled a rank holds the gathered shards and the merged tensors
(about two buckets) and releases the first before yielding, so beyond its own shards a rank
keeps at most one bucket once it is yielded. `StreamStats` records the largest buffer and the
most bytes the stream held at once. Consumers must copy what they keep: with PP = TP = 1 the
yielded tensors alias the live parameters.

`receive=False` ranks take part in every collective but yield nothing (and are sent no experts);
iterate the stream to the end on them too (`consume(stream)`), or the other ranks block.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megarl.models.bridge import expert_hf_names, hf_shapes, merge_shards, param_maps, shard_group
from megarl.models.builder import unwrap
from megarl.weights import expert_delivery

_ALIGN = 64  # byte alignment of each tensor inside a packed buffer (view(dtype) needs it)
Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class StreamStats:
    """What one stream allocated: the largest single buffer, the most bytes it allocated for one
    bucket (this rank's packed shards, the gathered shards, the merged tensors, the expert parts
    sent and received, the PP broadcast buffer: a bound on its working set, since some of them
    die before others are made), and the buckets it made."""

    largest_buffer: int = 0
    peak_bytes: int = 0
    buckets: int = 0
    _live: int = field(default=0, repr=False)

    def hold(self, nbytes: int) -> None:
        self.largest_buffer = max(self.largest_buffer, int(nbytes))
        self._live += int(nbytes)
        self.peak_bytes = max(self.peak_bytes, self._live)

    def release(self) -> None:
        """A new bucket: the previous one's buffers are the consumer's now."""
        self._live = 0


@dataclass(frozen=True)
class _Entry:
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    layout: str
    expert: tuple[int, int] | None = None  # a routed expert's tensors: (layer, global expert)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def tensor_bytes(self) -> list[int]:
        size = torch.empty((), dtype=self.torch_dtype).element_size()
        return [size * math.prod(s) for s in self.hf_shapes]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n) for n in self.tensor_bytes())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _local_entries(models, spec, ep: int, ep_rank: int, dtype: torch.dtype | None):
    """This stage's entries in stream order and, per entry, (ParamMap, the local parameter: a
    list for a fused expert tensor, None for a routed expert another EP rank holds)."""
    entries, params, fused = [], [], {}
    experts: list = []  # the routed experts of the current layer: (global expert, order, entry, param)

    def flush():  # a layer's routed experts, in HF order (expert 0's tensors first)
        for _, _, e, p in sorted(experts, key=lambda x: x[:2]):
            entries.append(e)
            params.append(p)
        experts.clear()

    for model in models:
        for pm, param in param_maps(model, spec):
            if not pm.export:
                continue
            if pm.hf_expert is not None and pm.hf_names in fused:  # another local expert of that tensor
                params[fused[pm.hf_names]][1].append(param)
                continue
            out_dtype = str(param.dtype if pm.buffer else dtype or param.dtype).removeprefix("torch.")  # a router's bias stays float32
            shapes = tuple(hf_shapes(pm, tuple(param.shape), spec, shard_group(pm)[0]))
            if pm.expert is not None and pm.hf_expert is None:  # one entry per EP rank's copy of this slot
                names, k, per = expert_hf_names(pm, spec, ep), len(pm.hf_names), spec.num_experts // ep
                layer = _layer(pm.hf_names[0])
                for r in range(ep):
                    e = r * per + pm.expert
                    experts.append((e, len(experts), _Entry(names[r * k:(r + 1) * k], shapes, out_dtype, pm.layout,
                                                            (layer, e)), (pm, param if r == ep_rank else None)))
                continue
            flush()
            names = pm.hf_names
            if pm.hf_expert is not None:  # all local experts of the layer, stacked at gather time
                fused[names], param = len(params), [param]
            entries.append(_Entry(names, shapes, out_dtype, pm.layout))
            params.append((pm, param))
    flush()
    return entries, params


def _layer(hf_name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", hf_name).group(1))


def _plan(stage_entries: list[list[_Entry]], bucket_bytes: int) -> list[tuple[int, list[int]]]:
    """Buckets as (owner stage, entry indices into that stage's list), in stream order."""
    plan = []
    for stage, entries in enumerate(stage_entries):
        cur, size = [], 0
        for i, e in enumerate(entries):
            if cur and size + e.nbytes > bucket_bytes:
                plan.append((stage, cur))
                cur, size = [], 0
            cur.append(i)
            size += e.nbytes
        if cur:
            plan.append((stage, cur))
    return plan


def _all_gather_packed(tensors: list[torch.Tensor], size: int, group, stats=None) -> list[list[torch.Tensor]]:
    """[tensor][rank] copies of `tensors` (same shapes on every rank of `group`), one all-gather."""
    flat = torch.cat([_as_bytes(t) for t in tensors])
    bufs = [torch.empty_like(flat) for _ in range(size)]
    if stats is not None:  # this rank's shards, and what the group gathers (one buffer per rank)
        stats.hold(flat.numel())
        stats.hold(flat.numel() * size)
    dist.all_gather(bufs, flat, group=group)
    out, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append([b[offset:offset + n].view(t.dtype).view(t.shape) for b in bufs])
        offset += n
    return out


def _gather_tp(items, spec, stats=None, source=None, device=None) -> list[list[torch.Tensor]]:
    """HF tensors of each (pm, param, entry) in `items`: TP shards (expert-TP for experts)
    all-gathered in one call per group; a fused expert tensor's parts then all-gathered over EP
    (rank-major). Every rank of a group passes the same items. `source(param)`: where its values
    are (a host copy, moved to `device` here)."""
    from megatron.core import parallel_state as ps

    read = (lambda p: p.detach()) if source is None else (lambda p: source(p).detach().to(device))
    local = [torch.stack([read(p) for p in param]).to(e.torch_dtype) if isinstance(param, list)
             else read(param).to(e.torch_dtype) for _, param, e in items]
    out: list = [None] * len(items)
    for is_expert, group in ((False, ps.get_tensor_model_parallel_group()),
                             (True, ps.get_expert_tensor_parallel_group())):
        ks = [k for k, (pm, _, _) in enumerate(items) if (pm.expert is not None) == is_expert]
        size = dist.get_world_size(group) if ks else 1
        sharded = [k for k in ks if items[k][0].layout != "replicated" and size > 1]
        gathered = (dict(zip(sharded, _all_gather_packed([local[k] for k in sharded], size, group, stats)))
                    if sharded else {})
        for k in ks:
            out[k] = merge_shards(items[k][0], gathered.get(k, [local[k]]), spec)
            if stats is not None:  # merging copies (cat, split views of the copy); a replicated one aliases
                base = local[k].untyped_storage().data_ptr()
                stats.hold(sum(_nbytes(t) for t in out[k] if t.untyped_storage().data_ptr() != base))
    fused = [k for k, (pm, _, _) in enumerate(items) if pm.hf_expert is not None]
    ep = ps.get_expert_model_parallel_world_size()
    if fused and ep > 1:
        per_rank = iter(_all_gather_packed([t for k in fused for t in out[k]], ep,
                                           ps.get_expert_model_parallel_group(), stats))
        for k in fused:  # parts of one HF tensor, experts in EP-rank order
            out[k] = [torch.cat(next(per_rank)) for _ in out[k]]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_experts(layer: int, expert: int) -> bool:
    return True


def no_experts(layer: int, expert: int) -> bool:
    return False


def stream_hf_weights(model_chunks, hf_config: Any = None, bucket_bytes: int = 256 << 20, *,
                      receive: bool = True, dtype: torch.dtype | None = None,
                      want_expert: Callable[[int, int], bool] | None = None,
                      stats: StreamStats | None = None,
                      source: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[Bucket]:
    """Yields buckets [(hf_name, full_tensor)] of the whole model on every receiving rank.

    model_chunks: this rank's GPTModel chunk(s), possibly DDP-wrapped. hf_config: optional; when
    given it must describe the same architecture. dtype: cast tensors (e.g. bf16 for SGLang), except
    the buffers that are HF tensors (routers' e_score_correction_bias: float32, as HF keeps them).
    want_expert(layer, global expert): the routed experts this rank receives (default: all when
    `receive`, none otherwise); a rank's other experts never reach it. stats: filled with what the
    stream held (`StreamStats`). source(param): the tensor holding a parameter's values when that is
    not the parameter (its host copy while the weights are offloaded: rollout.sync_from_host); each
    bucket's shards are copied to the parameters' device before they are gathered.
    """
    from megatron.core import parallel_state as ps

    from megarl.models.families import arch_spec

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    models = [unwrap(c) for c in chunks]
    spec = models[0].arch_spec
    if hf_config is not None and arch_spec(hf_config) != spec:
        raise ValueError("hf_config does not describe the architecture the model was built from")
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size()
    entries, params = _local_entries(models, spec, ep, ps.get_expert_model_parallel_rank(), dtype)
    if pp > 1:
        stage_entries: list = [None] * pp
        dist.all_gather_object(stage_entries, entries, group=pp_group)
    else:
        stage_entries = [entries]
    device = next((p.device for _, p in params if torch.is_tensor(p)), torch.device("cpu"))
    parts = [e.expert for es in stage_entries for e in es if e.expert is not None]
    emap = None
    if parts:
        want = want_expert or (all_experts if receive else no_experts)
        emap = expert_delivery.ExpertMap.gather(sorted(set(parts)), want, spec.num_experts // ep)
    stats = stats if stats is not None else StreamStats()

    with torch.no_grad():
        for stage, idx in _plan(stage_entries, bucket_bytes):
            stats.release()
            stats.buckets += 1
            bucket = [stage_entries[stage][i] for i in idx]
            dense = [k for k, e in enumerate(bucket) if e.expert is None]
            routed = [k for k, e in enumerate(bucket) if e.expert is not None]
            tensors: dict[int, list[torch.Tensor]] = {}
            if stage == pp_rank:  # dense tensors and the routed experts this rank holds
                mine = [k for k in dense + routed if params[idx[k]][1] is not None]
                items = [(*params[idx[k]], bucket[k]) for k in mine]
                tensors = dict(zip(mine, _gather_tp(items, spec, stats, source, device)))
            if routed:
                got = expert_delivery.deliver(
                    emap, stage, [bucket[k].expert for k in routed], [bucket[k].hf_shapes for k in routed],
                    [bucket[k].torch_dtype for k in routed],
                    {i: tensors[k] for i, k in enumerate(routed) if k in tensors}, device, stats)
                experts = {routed[i]: ts for i, ts in got.items()}
            else:
                experts = {}
            if pp > 1:
                received = _broadcast_bucket([bucket[k] for k in dense], [tensors.get(k) for k in dense],
                                             stage, pp_group, device, stats)
                tensors = dict(zip(dense, received))
            if not receive and want_expert is None:
                continue
            out = [(n, t) for k in sorted(dense + list(experts)) if k in dense and receive or k in experts
                   for n, t in zip(bucket[k].hf_names, experts[k] if k in experts else tensors[k])]
            if out:
                yield out


def _broadcast_bucket(entries: list[_Entry], tensors: list, stage: int, pp_group, device, stats) -> list[list]:
    """The entries' tensors on every stage: the owning stage packs them into one buffer and
    broadcasts it over the PP group; the tensors returned are views into that buffer."""
    layout = []  # (entry, tensor within it, shape, dtype, offset, nbytes)
    offset = 0
    for k, e in enumerate(entries):
        for j, (shape, n) in enumerate(zip(e.hf_shapes, e.tensor_bytes())):
            layout.append((k, j, shape, e.torch_dtype, offset, n))
            offset += _aligned(n)
    if not layout:
        return []
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    stats.hold(offset)
    if tensors and tensors[0] is not None:
        for k, j, _, _, off, n in layout:
            buf[off:off + n] = _as_bytes(tensors[k][j])
    dist.broadcast(buf, src=dist.get_global_rank(pp_group, stage), group=pp_group)
    out: list[list] = [[] for _ in entries]
    for k, _, shape, dt, off, n in layout:
        out[k].append(buf[off:off + n].view(dt).view(shape))
    return out


def consume(stream) -> None:
    """Runs a stream to the end (ranks that take part in the collectives but keep nothing)."""
    for _ in stream:
        pass
