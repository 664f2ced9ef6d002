"""Worker for tests/distributed/test_threaded_writer.py (2 gloo ranks): megatron's torch_dist save
with megarl's threaded writer while os.fork raises, then a load of what it wrote."""

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights.threaded_writer import use_threaded_writers
from tests.distributed.harness import finish, gather, on_rank0, parse_args


def state(rank: int, world: int, fill=None) -> dict:
    rows = torch.arange(24, dtype=torch.float32).view(4, 6)[rank * 2: rank * 2 + 2]  # this rank's 2 of 4 rows
    rep = torch.linspace(0, 1, 7)
    if fill is not None:
        rows, rep = torch.full_like(rows, fill), torch.full_like(rep, fill)
    return {"w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)),
            "r": ShardedTensor.from_rank_offsets("r", rep, replica_id=rank)}


def main():
    a = parse_args(threaded=1)
    init_distributed(ParallelSizes(tp=1), seed=0)  # gloo + the CPU runtime, as the trainer runs
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.threaded:
        use_threaded_writers()

    def no_fork():
        raise AssertionError("the checkpoint writer forked")

    os.fork = no_fork
    ckpt = a.root / "ckpt"
    on_rank0(ckpt.mkdir)
    res = {}
    try:
        dist_checkpointing.save(state(rank, world), str(ckpt))
        dist.barrier()
        loaded = dist_checkpointing.load(state(rank, world, fill=-1.0), str(ckpt))
        want = state(rank, world)
        res["equal"] = all(torch.equal(loaded[k], want[k].data) for k in want)
        res["files"] = sorted(x.name for x in ckpt.iterdir())
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    finish(a.out, gather(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
