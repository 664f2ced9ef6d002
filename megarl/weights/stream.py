"""Stream full, HF-named tensors out of any TP/PP/VPP Megatron layout, in bounded buckets.

This is the weights contract (docs/design.md, "Contracts"): the HF exporter, the builtin engine and the SGLang
engine all consume `stream_hf_weights(...)`, an iterator of buckets `[(hf_name, tensor), ...]`.

How a bucket is made (every rank runs the same plan, so collectives line up):
1. Once per call, each pipeline stage's parameter list (HF names, HF shapes, dtype, TP layout)
   is all-gathered over the PP group; every rank then cuts the same buckets of at most
   `bucket_bytes` (a bigger single tensor gets a bucket of its own), each owned by one stage.
2. On the owning stage, the TP-sharded parameters of the bucket are packed into one byte
   buffer and all-gathered over the TP group, then merged into HF tensors (fused QKV split into
   q/k/v, gated fc1 into gate/up, vocab padding cut); replicated parameters are taken locally.
   MoE experts: a local expert slot's shards are gathered over the expert-TP group, merged, and
   the merged tensors of every EP rank's same slot all-gathered over the EP group, so a bucket
   entry carries that slot's full HF tensors for all EP ranks (`bridge.expert_hf_names`). Where
   HF keeps all experts of a layer in one tensor (`ParamMap.hf_expert`, qwen3_vl_moe), one entry
   holds all local experts of the layer, and the EP ranks' parts are concatenated in rank order.
3. With PP > 1 the owner packs the HF tensors into one byte buffer and broadcasts it over the PP
   group; the other stages receive it. The yielded tensors are views into that buffer.

Memory: while a bucket is assembled a rank holds the gathered shards and the merged tensors
(about two buckets) and releases the first before yielding, so beyond its own shards a rank
keeps at most one bucket once it is yielded. Consumers must copy what they keep: with PP = TP = 1
the yielded tensors alias the live parameters.

`receive=False` ranks take part in every collective but yield nothing; iterate the stream to
the end on them too (`consume(stream)`), or the other ranks block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megarl.models.bridge import expert_hf_names, hf_shapes, merge_shards, param_maps, shard_group
from megarl.models.builder import unwrap

_ALIGN = 64  # byte alignment of each tensor inside a packed buffer (view(dtype) needs it)
Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class _Entry:
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    layout: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def tensor_bytes(self) -> list[int]:
        size = torch.empty((), dtype=self.torch_dtype).element_size()
        return [size * _numel(s) for s in self.hf_shapes]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n) for n in self.tensor_bytes())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _local_entries(models, spec, ep: int, dtype: torch.dtype | None):
    entries, params, fused = [], [], {}
    for model in models:
        for pm, param in param_maps(model, spec):
            if not pm.export:
                continue
            if pm.hf_expert is not None and pm.hf_names in fused:  # another local expert of that tensor
                params[fused[pm.hf_names]][1].append(param)
                continue
            out_dtype = param.dtype if pm.buffer else dtype or param.dtype  # a router's bias stays float32
            shapes = tuple(hf_shapes(pm, tuple(param.shape), spec, shard_group(pm)[0]))
            names = pm.hf_names
            if pm.hf_expert is not None:  # all local experts of the layer, stacked at gather time
                fused[names], param = len(params), [param]
            elif pm.expert is not None:  # this slot on every EP rank
                names, shapes = expert_hf_names(pm, spec, ep), shapes * ep
            entries.append(_Entry(names, shapes, str(out_dtype).removeprefix("torch."), pm.layout))
            params.append((pm, param))
    return entries, params


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


def _all_gather_packed(tensors: list[torch.Tensor], size: int, group) -> list[list[torch.Tensor]]:
    """[tensor][rank] copies of `tensors` (same shapes on every rank of `group`), one all-gather."""
    flat = torch.cat([_as_bytes(t) for t in tensors])
    bufs = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(bufs, flat, group=group)
    out, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append([b[offset:offset + n].view(t.dtype).view(t.shape) for b in bufs])
        offset += n
    return out


def _gather_tp(items, spec) -> list[list[torch.Tensor]]:
    """HF tensors of each (pm, param, entry) in `items`: TP shards (expert-TP for experts)
    all-gathered in one call per group; expert tensors then all-gathered over EP (rank-major)."""
    from megatron.core import parallel_state as ps

    local = [torch.stack([p.detach() for p in param]).to(e.torch_dtype) if isinstance(param, list)
             else param.detach().to(e.torch_dtype) for _, param, e in items]
    out: list = [None] * len(items)
    experts = [k for k, (pm, _, _) in enumerate(items) if pm.expert is not None]
    for is_expert, group in ((False, ps.get_tensor_model_parallel_group()),
                             (True, ps.get_expert_tensor_parallel_group())):
        ks = [k for k, (pm, _, _) in enumerate(items) if (pm.expert is not None) == is_expert]
        size = dist.get_world_size(group) if ks else 1
        sharded = [k for k in ks if items[k][0].layout != "replicated" and size > 1]
        gathered = dict(zip(sharded, _all_gather_packed([local[k] for k in sharded], size, group))) if sharded else {}
        for k in ks:
            out[k] = merge_shards(items[k][0], gathered.get(k, [local[k]]), spec)
    ep = ps.get_expert_model_parallel_world_size()
    if experts and ep > 1:
        per_rank = iter(_all_gather_packed([t for k in experts for t in out[k]], ep,
                                           ps.get_expert_model_parallel_group()))
        for k in experts:
            mine = [next(per_rank) for _ in out[k]]  # [tensor][ep rank]
            if items[k][0].hf_expert is not None:  # parts of one HF tensor, experts in EP-rank order
                out[k] = [torch.cat(parts) for parts in mine]
            else:
                out[k] = [mine[j][r] for r in range(ep) for j in range(len(mine))]
    return out


def stream_hf_weights(model_chunks, hf_config: Any = None, bucket_bytes: int = 256 << 20, *,
                      receive: bool = True, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Yields buckets [(hf_name, full_tensor)] of the whole model on every receiving rank.

    model_chunks: this rank's GPTModel chunk(s), possibly DDP-wrapped. hf_config: optional; when
    given it must describe the same architecture. dtype: cast tensors (e.g. bf16 for SGLang), except
the buffers that are HF tensors (routers' e_score_correction_bias: float32, as HF keeps them).
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
    entries, params = _local_entries(models, spec, ps.get_expert_model_parallel_world_size(), dtype)
    if pp > 1:
        stage_entries: list = [None] * pp
        dist.all_gather_object(stage_entries, entries, group=pp_group)
    else:
        stage_entries = [entries]
    device = params[0][1].device if params else torch.device("cpu")

    with torch.no_grad():
        for stage, idx in _plan(stage_entries, bucket_bytes):
            owner = stage == pp_rank
            tensors = None
            if owner:
                items = [(params[i][0], params[i][1], entries[i]) for i in idx]
                tensors = [t for group_ in _gather_tp(items, spec) for t in group_]
            if pp == 1:
                if receive:
                    names = [n for i in idx for n in entries[i].hf_names]
                    yield list(zip(names, tensors))
                continue
            yield from _broadcast_bucket(stage_entries[stage], idx, tensors, stage, pp_group,
                                         device, receive)


def _broadcast_bucket(stage_entries, idx, tensors, stage, pp_group, device, receive):
    layout = []  # (name, shape, dtype, offset, nbytes)
    offset = 0
    for i in idx:
        e = stage_entries[i]
        for name, shape, n in zip(e.hf_names, e.hf_shapes, e.tensor_bytes()):
            layout.append((name, shape, e.torch_dtype, offset, n))
            offset += _aligned(n)
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    if tensors is not None:
        for (_, _, _, off, n), t in zip(layout, tensors):
            buf[off:off + n] = _as_bytes(t)
        del tensors
    dist.broadcast(buf, src=dist.get_global_rank(pp_group, stage), group=pp_group)
    if receive:
        yield [(name, buf[off:off + n].view(dt).view(shape)) for name, shape, dt, off, n in layout]


def consume(stream) -> None:
    """Runs a stream to the end (ranks that take part in the collectives but keep nothing)."""
    for _ in stream:
        pass
