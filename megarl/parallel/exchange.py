"""Host-side collectives for a step's rollout data, with byte accounting.

A step's trajectories (token ids, log-probs, routed experts, images) never pass through the GPU
on their way between ranks: they move over `distributed.host_group()`, a gloo group of the whole
world made by `init_distributed` beside the default (NCCL on GPUs) group. Staging a payload on the GPU would
cost memory the colocated engine or the training state needs at that moment, and torch's
`all_gather_object` on an NCCL group stages world x the largest contribution on every GPU.

Every collective of the step's data path goes through here (`megarl.trainer.rows` uses them):
`all_gather_objects` for the small per-sample metadata every rank decides on, `all_to_all_bytes`
for the payloads, which move once from the rank that generated a row to the ranks that train it,
and `all_reduce_host` for per-sample scalar vectors and metric sums. Each call adds the bytes it
delivered to this rank to `traffic()[phase][kind]` (phase: the innermost
`megarl.parallel.distributed.phase`), which `tools/bench/scale.py` reads.
"""

from __future__ import annotations

import pickle
from collections import defaultdict

import torch
import torch.distributed as dist

from megarl.parallel.distributed import current_phase, host_group

_TRAFFIC: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def traffic() -> dict[str, dict[str, int]]:
    """Bytes delivered to this rank by the calls of this module: {phase: {kind: bytes}}."""
    return {p: dict(k) for p, k in _TRAFFIC.items()}


def reset_traffic() -> None:
    _TRAFFIC.clear()


def count(kind: str, nbytes: int) -> None:
    """Adds `nbytes` delivered to this rank under the current phase (for megarl's collectives on
    other groups that carry per-sample data, e.g. the DP all-reduce of per-sample scores)."""
    _TRAFFIC[current_phase()][kind] += int(nbytes)



def _group_size() -> int:
    group = host_group()
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("megarl.parallel.exchange needs the host group of init_distributed "
                           "(megarl.parallel.distributed); torch.distributed was started another way")
    return dist.get_world_size(group) if group is not None else 1


def all_gather_objects(obj, kind: str = "meta") -> list:
    """Every rank's picklable `obj`, in rank order, on every rank (small metadata only: each rank
    receives world x the largest pickled contribution)."""
    if _group_size() == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_group_size())]
    dist.all_gather(sizes, size, group=host_group())
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded, group=host_group())
    count(kind, longest * (len(parts) - 1))
    return [pickle.loads(p[: int(n)].numpy().tobytes()) for p, n in zip(parts, sizes)]


def gather_objects(obj, dst: int = 0, kind: str = "gather") -> list | None:
    """Every rank's picklable `obj`, in rank order, on rank `dst` only (None elsewhere)."""
    if _group_size() == 1:
        return [obj]
    me = dist.get_rank(host_group())
    parts = [None] * _group_size() if me == dst else None
    dist.gather_object(obj, parts, dst=dst, group=host_group())
    if me == dst:
        count(kind, sum(len(pickle.dumps(p)) for r, p in enumerate(parts) if r != dst))
    return parts


def all_to_all_bytes(sends: list[bytes], kind: str = "payload") -> list[bytes]:
    """sends[r]: what this rank sends to rank r (b"" for nothing); returns what each rank sent to
    this one. One variable-size all-to-all; a rank receives exactly the bytes addressed to it."""
    n = _group_size()
    if len(sends) != n:
        raise ValueError(f"all_to_all_bytes: {len(sends)} messages for a world of {n}")
    if n == 1:
        return list(sends)
    out_sizes = torch.tensor([len(b) for b in sends], dtype=torch.int64)
    in_sizes = torch.empty_like(out_sizes)
    dist.all_to_all_single(in_sizes, out_sizes, group=host_group())
    flat = torch.frombuffer(bytearray(b"".join(sends)), dtype=torch.uint8) if out_sizes.sum() else \
        torch.zeros(0, dtype=torch.uint8)
    received = torch.empty(int(in_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(received, flat, in_sizes.tolist(), out_sizes.tolist(), group=host_group())
    me = dist.get_rank(host_group())
    count(kind, int(in_sizes.sum()) - int(in_sizes[me]))
    offsets = [0] + in_sizes.cumsum(0).tolist()
    raw = received.numpy().tobytes()
    return [raw[offsets[r]: offsets[r + 1]] for r in range(n)]


def all_reduce_host(t: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "scalars") -> torch.Tensor:
    """A host tensor reduced over the world (per-sample scalar vectors, metric sums); a copy."""
    out = t.detach().cpu().clone()
    if _group_size() > 1:
        dist.all_reduce(out, op=op, group=host_group())
        count(kind, out.numel() * out.element_size())
    return out
