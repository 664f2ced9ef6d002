"""Optimizer checkpoint memory: peak bytes per rank of saving and loading the distributed
optimizer's torch_dist checkpoint at several DP sizes, megatron's gathering writer (megarl's
optimizer checkpoint before the sharded one) against megarl.weights.optim_ckpt.

    python -m tools.bench.checkpoint_memory                  # DP 2 and 4, hidden 256, 4 layers, vocab 32000
    python -m tools.bench.checkpoint_memory --dp 2 4 8 --hidden 512

Method: for every DP size a fresh torchrun job of DP ranks (TP=PP=1; gloo on CPU, NCCL on GPU)
builds the same randomly initialised Qwen2-shaped model (fp32, megatron DDP + distributed
optimizer, Adam) and takes one training step, so the optimizer holds its state. Then, per writer,
in this order: save the optimizer (build its sharded state dict + dist_checkpointing.save,
synchronous) and load it back into the same optimizer (sharded state dict for loading +
dist_checkpointing.load + putting the state into the optimizer). Memory: the peak, during each of
these two blocks, of the memory in use above what was in use just before it; on CPU the heap in
use (glibc mallinfo2 over every arena, sampled every 1 ms by a thread, as tools.bench.long_context:
torch's CPU tensors, gloo's buffers, torch DCP's read and write buffers all come from malloc), on
GPU torch.cuda.max_memory_allocated (device memory only). The largest value over the ranks is
printed, beside the rank's own optimizer shard (12 bytes x the parameters its distributed
optimizer owns: fp32 main weights + 2 Adam moments) and the model's whole optimizer state (12 x
parameters).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.checkpoint_memory`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools._options import add_options
from tools.bench.long_context import PeakHeap

REPO = Path(__file__).resolve().parents[2]
WRITERS = ("gathered", "sharded")


def _peak(fn) -> int:
    """Bytes: the peak of memory in use during fn() above the level just before it."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with PeakHeap() as heap:
        fn()
    return heap.peak - heap.base


def _gathered_save(model, opt_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    from megarl.weights import dist_ckpt

    sd = model.optimizer.sharded_state_dict(dist_ckpt.model_sharded_state_dict(model.chunks),
                                            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    dist_checkpointing.save(sd, str(opt_dir))


def _gathered_load(model, opt_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    from megarl.weights import dist_ckpt

    sd = model.optimizer.sharded_state_dict(dist_ckpt.model_sharded_state_dict(model.chunks), is_loading=True,
                                            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    model.optimizer.load_state_dict(dist_checkpointing.load(sd, str(opt_dir)))


def _sharded_save(model, opt_dir: Path) -> None:
    from megarl.weights import dist_ckpt, optim_ckpt

    optim_ckpt.save(model.optimizer, dist_ckpt.model_sharded_state_dict(model.chunks), opt_dir)


def _sharded_load(model, opt_dir: Path) -> None:
    from megarl.weights import dist_ckpt, optim_ckpt

    optim_ckpt.load(model.optimizer, dist_ckpt.model_sharded_state_dict(model.chunks), opt_dir)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config

    from megarl.config.schema import OptimConfig
    from megarl.parallel.distributed import ParallelSizes, init_distributed
    from megarl.trainer.batch import StepBatch, Trajectory
    from megarl.trainer.train_model import TrainModel
    from megarl.weights.threaded_writer import use_threaded_writers

    init_distributed(ParallelSizes(), seed=0)
    use_threaded_writers()  # megarl's writer threads, for both writers (TrainModel.save does this)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = TrainModel(cfg, OptimConfig(lr=1e-4, use_distributed_optimizer=True), dtype="fp32", seed=0)
    ids = torch.randint(0, args.vocab, (64,), generator=torch.Generator().manual_seed(dist.get_rank())).tolist()
    batch = StepBatch.from_trajectories([Trajectory("0", ids[:8], ids[8:], [], "stop")])
    model.train_step(batch, lambda mb, logits: (-mb.log_probs(logits).sum() / 64, {}))
    owned = sum(r["param"].size for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer])
                for per_dtype in opt.gbuf_ranges for buckets in per_dtype.values() for b in buckets
                for r in b["param_map"].values())
    params = sum(p.numel() for c in model.modules for p in c.parameters())
    out = {"own_shard": 12 * owned, "whole": 12 * params}
    steps = {"gathered": (_gathered_save, _gathered_load), "sharded": (_sharded_save, _sharded_load)}
    for writer in WRITERS:
        opt_dir = Path(args.dir) / writer
        if dist.get_rank() == 0:
            opt_dir.mkdir(parents=True)
        dist.barrier()
        save, load = steps[writer]
        out[f"{writer}_save"] = _peak(lambda: save(model, opt_dir))
        dist.barrier()
        out[f"{writer}_load"] = _peak(lambda: load(model, opt_dir))
        dist.barrier()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, out)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))


def run_point(args, dp: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp), "--master-port",
               str(29500 + (os.getpid() + dp) % 1000), "-m", "tools.bench.checkpoint_memory", "--worker",
               "--out", str(out), "--dir", str(Path(tmp) / "ckpt"), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--vocab", str(args.vocab)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DP={dp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def table(points: dict[int, list[dict]]) -> str:
    mib = 2**20
    lines = ["| writer | DP | save peak MiB / rank | load peak MiB / rank | own optimizer shard MiB | "
             "save / shard | load / shard |", "|---|---|---|---|---|---|---|"]
    for writer in WRITERS:
        for dp, ranks in points.items():
            save = max(r[f"{writer}_save"] for r in ranks)
            load = max(r[f"{writer}_load"] for r in ranks)
            shard = max(r["own_shard"] for r in ranks)
            lines.append(f"| {writer} | {dp} | {save / mib:.1f} | {load / mib:.1f} | {shard / mib:.1f} | "
                         f"{save / shard:.2f} | {load / shard:.2f} |")
    whole = points[next(iter(points))][0]["whole"]
    lines.append(f"\nwhole optimizer state of the model (12 B x parameters): {whole / mib:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, hidden=256, layers=4, vocab=32000, out="", dir="")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--worker", action="store_true")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    points = {dp: run_point(args, dp) for dp in args.dp}
    print(f"model: Qwen2-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
          f"distributed optimizer, TP=PP=1")
    print(table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
