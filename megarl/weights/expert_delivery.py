"""Routed experts of one weight-stream bucket, from the ranks that hold them to the ranks that want
them, point to point (megarl/weights/stream.py).

A routed expert (layer l, global expert e) lives on every rank of its pipeline stage whose EP rank
is e // (E / EP): the expert-TP ranks of that EP rank hold its shards (merged into full HF tensors
before delivery) and the expert-data-parallel replicas hold copies. Every rank says once per
stream which experts it wants (`want`: the builtin engine every expert, an engine with expert
parallelism only its own, a rank that receives nothing none). For each bucket, receiver j gets
each wanted expert from holder number j mod (number of holders), so the sends spread over the
replicas; a holder that wants its own experts uses them in place. Each (holder, receiver) pair
exchanges one packed buffer per bucket, so a rank never holds more than the bucket's experts it
wants, whatever the EP size and the expert count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megarl.parallel import exchange

Part = tuple[int, int]  # (layer, global expert)


@dataclass(frozen=True)
class ExpertMap:
    """Who holds and who wants every routed expert of the model: the same on every rank."""

    stage_of: tuple[int, ...]  # pipeline stage of every global rank
    ep_of: tuple[int, ...]  # EP rank of every global rank
    wants: np.ndarray  # [world, len(parts)] bool
    parts: tuple[Part, ...]  # every routed expert of the model, in a fixed order
    experts_per_rank: int  # E / EP

    @classmethod
    def gather(cls, parts: list[Part], want, experts_per_rank: int) -> "ExpertMap":
        """Collective over the world: `want(layer, expert) -> bool` of this rank, evaluated for
        every part, and this rank's stage and EP rank."""
        from megatron.core import parallel_state as ps

        mine = np.packbits(np.array([bool(want(*p)) for p in parts], dtype=bool))
        every = exchange.all_gather_objects((ps.get_pipeline_model_parallel_rank(),
                                             ps.get_expert_model_parallel_rank(), mine), "setup")
        wants = np.stack([np.unpackbits(w, count=len(parts)).astype(bool) for _, _, w in every]) if parts else \
            np.zeros((len(every), 0), dtype=bool)
        return cls(tuple(s for s, _, _ in every), tuple(e for _, e, _ in every), wants, tuple(parts), experts_per_rank)

    def holders(self, stage: int, expert: int) -> list[int]:
        ep = expert // self.experts_per_rank
        return [r for r in range(len(self.stage_of)) if self.stage_of[r] == stage and self.ep_of[r] == ep]


def route(emap: ExpertMap, stage: int, bucket: list[Part]) -> dict[tuple[int, int], list[int]]:
    """{(holder, receiver): indices into `bucket` the holder sends the receiver}, in bucket order;
    receiver == holder means the holder keeps its own copy."""
    index = {p: i for i, p in enumerate(emap.parts)}
    out: dict[tuple[int, int], list[int]] = {}
    for k, (layer, expert) in enumerate(bucket):
        holders = emap.holders(stage, expert)
        want = emap.wants[:, index[(layer, expert)]]
        for j in np.flatnonzero(want):
            h = int(j) if int(j) in holders else holders[int(j) % len(holders)]
            out.setdefault((h, int(j)), []).append(k)
    return out


def deliver(emap: ExpertMap, stage: int, bucket: list[Part], shapes: list[list[tuple[int, ...]]],
            dtypes: list[torch.dtype], own: dict[int, list[torch.Tensor]], device, stats=None) -> dict[int, list[torch.Tensor]]:
    """Collective over the world: {k: the HF tensors of bucket[k]} for every part this rank wants.
    `own`: the full tensors of the parts this rank holds (k -> tensors); shapes / dtypes: of every
    part's tensors."""
    rank = dist.get_rank()
    plan = route(emap, stage, bucket)
    got = {k: own[k] for (h, j), ks in plan.items() if h == j == rank for k in ks}
    ops, recv, packs = [], [], {}
    for (h, j), ks in plan.items():
        if h == j or rank not in (h, j):
            continue
        if h == rank:  # one packed buffer per receiver, shared by the receivers that get the same parts
            new = tuple(ks) not in packs
            if new:
                packs[tuple(ks)] = torch.cat([t.contiguous().view(-1).view(torch.uint8) for k in ks for t in own[k]])
            buf = packs[tuple(ks)]
            ops.append(dist.P2POp(dist.isend, buf, j))
            if stats is not None and new:
                stats.hold(buf.numel())
        else:
            n = sum(math.prod(s) * dtypes[k].itemsize for k in ks for s in shapes[k])
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, h))
            recv.append((buf, ks))
            if stats is not None:
                stats.hold(buf.numel())
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buf, ks in recv:
        offset = 0
        for k in ks:
            tensors = []
            for s in shapes[k]:
                n = math.prod(s) * dtypes[k].itemsize
                tensors.append(buf[offset: offset + n].view(dtypes[k]).view(s))
                offset += n
            got[k] = tensors
        exchange.count("weights", buf.numel())
    return got
