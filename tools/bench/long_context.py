"""Long-context benchmark: peak memory per rank and time of one log-prob + backward pass at
context-parallel sizes 1 and 2, through the trainer's own path.

    python -m tools.bench.long_context                          # 2k 4k 8k 16k tokens, CP 1 and 2
    python -m tools.bench.long_context --lengths 4096 --cp 1 2 4
    python -m tools.bench.long_context --lengths 16384 --cp 1 --recompute full

Method: for every (CP, length) a fresh torchrun job of CP ranks (gloo on CPU, NCCL on GPU) builds
a randomly initialised Qwen2-shaped model (--hidden/--layers/--heads/--kv-heads/--vocab), and runs
one `TrainModel.train_step` on a single sequence of that length (1 prompt token, the rest
response) with the summed response log-likelihood as the loss: megarl's local attention
(blockwise, K/V all-gathered over CP), chunked log-probs (model.logprob_chunk_tokens), megatron
DDP over the CP group, Adam. Memory: the peak of memory in use above what was in use just before
the pass; on CPU the heap in use (glibc mallinfo2, sampled every 1 ms by a thread; torch's CPU
allocator takes its memory from malloc), on GPU torch.cuda.max_memory_allocated. A fresh process
per point. Time: wall time of the pass (after one warm-up pass
at 1/8 of the length). The largest value over ranks is printed.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.long_context`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from tools._options import add_options

REPO = Path(__file__).resolve().parents[2]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_in_use() -> int:
    """Bytes the process's malloc has handed out and not freed (glibc mallinfo2: in-use chunks of
    every arena + mmapped blocks); unlike the resident set size it drops when tensors are freed."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakHeap:
    """Samples the heap in use in a thread; `.peak - .base` is the growth during the block."""

    def __enter__(self):
        self.base = self.peak = _heap_in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _heap_in_use())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _heap_in_use())


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config

    from megarl.config.schema import OptimConfig
    from megarl.parallel.distributed import ParallelSizes, init_distributed
    from megarl.trainer.batch import StepBatch, Trajectory
    from megarl.trainer.train_model import TrainModel

    init_distributed(ParallelSizes(cp=args.cp_size), seed=0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.length, 4096),
                      tie_word_embeddings=False)
    cuda = torch.cuda.is_available()
    optim = OptimConfig(lr=1e-6, max_tokens_per_microbatch=args.length + 64, use_distributed_optimizer=False)
    recompute = {} if args.recompute == "none" else {"recompute_granularity": args.recompute}
    if args.recompute == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    model = TrainModel(cfg, optim, dtype="bf16" if cuda else "fp32", impl="local", seed=0,
                       logprob_chunk_tokens=args.chunk, model_options=recompute)
    g = torch.Generator().manual_seed(0)

    def batch(n):
        ids = torch.randint(0, args.vocab, (n,), generator=g).tolist()
        return StepBatch.from_trajectories([Trajectory("0", ids[:1], ids[1:], [], "stop")])

    def loss(mb, logits):
        return -mb.log_probs(logits).sum() / args.length, {}

    model.train_step(batch(max(64, args.length // 8)), loss)  # warm-up
    b = batch(args.length)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with PeakHeap() as heap:
        model.train_step(b, loss)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    mem = (torch.cuda.max_memory_allocated() - base) if cuda else (heap.peak - heap.base)
    stats = torch.tensor([mem / 2**20, seconds], dtype=torch.float64)
    if cuda:
        stats = stats.cuda()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"mib": float(stats[0]), "s": float(stats[1])}))


def run_point(args, cp: int, length: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-port",
               str(29500 + (os.getpid() + length + cp) % 1000), __file__, "--worker", "--cp-size", str(cp),
               "--length", str(length), "--out", str(out), *_model_args(args)]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // cp)), PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"cp={cp} length={length} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _model_args(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
            "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab), "--chunk", str(args.chunk),
            "--recompute", args.recompute]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    add_options(p, hidden=256, layers=4, heads=4, kv_heads=2, vocab=8192)
    p.add_argument("--chunk", type=int, default=4096, help="model.logprob_chunk_tokens")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="model.recompute: activation recomputation (full: every layer, uniform, 1 layer per chunk)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cp-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads} kv, "
          f"vocab {args.vocab}, logprob chunk {args.chunk} tokens, recompute {args.recompute}")
    print(f"{'tokens':>7} " + " ".join(f"{f'cp{c} MiB':>10} {f'cp{c} s':>8}" for c in args.cp)
          + (f" {'mem cp' + str(args.cp[-1]) + '/cp' + str(args.cp[0]):>12}" if len(args.cp) > 1 else ""))
    for n in args.lengths:
        pts = [run_point(args, c, n) for c in args.cp]
        row = f"{n:>7} " + " ".join(f"{pt['mib']:>10.0f} {pt['s']:>8.2f}" for pt in pts)
        if len(pts) > 1:
            row += f" {pts[-1]['mib'] / pts[0]['mib']:>12.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
