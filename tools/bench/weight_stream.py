"""Weight-stream throughput vs a raw all_gather of the same bytes.

    .venv/bin/python -m tools.bench.weight_stream [--tp 2] [--layers 4 --hidden 256 --vocab 32000]
        [--bucket-mb 64] [--repeats 5]

Builds a random Qwen2-shaped model at TP=tp (starts tp ranks with torchrun unless already under
torchrun; gloo on CPU, nccl on GPU), then times
- `stream_hf_weights` end to end (TP all-gather, QKV/fc1 split, vocab cut, bucketing), and
- one `all_gather` of a flat buffer holding this rank's share of the same number of bytes,
and prints GB/s of each and their ratio (HF bytes delivered per second on every rank).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.weight_stream`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import os
import sys
import time
from tools._options import add_options



def bench(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from megarl.models import build_model
    from megarl.parallel.distributed import ParallelSizes, device, init_distributed
    from megarl.weights import stream_hf_weights

    init_distributed(ParallelSizes(tp=args.tp, pp=1), seed=0)
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False)
    model = build_model(cfg)
    bucket = int(args.bucket_mb * 2**20)

    def run_stream() -> int:
        n = 0
        for b in stream_hf_weights(model, cfg, bucket_bytes=bucket):
            n += sum(t.numel() * t.element_size() for _, t in b)
        return n

    total = run_stream()  # warm-up, and the byte count
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        run_stream()
    dist.barrier()
    t_stream = (time.perf_counter() - t0) / args.repeats

    world = dist.get_world_size()
    flat = torch.ones(total // world, dtype=torch.uint8, device=device())
    outs = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(outs, flat)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        dist.all_gather(outs, flat)
    dist.barrier()
    t_raw = (time.perf_counter() - t0) / args.repeats
    if dist.get_rank() == 0:
        gb = total / 1e9
        print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, tp={args.tp}, "
              f"{gb * 1e3:.1f} MB of HF tensors, buckets of {args.bucket_mb} MB, backend "
              f"{dist.get_backend()}")
        print(f"stream:     {t_stream * 1e3:8.1f} ms  {gb / t_stream:6.3f} GB/s")
        print(f"all_gather: {t_raw * 1e3:8.1f} ms  {gb / t_raw:6.3f} GB/s")
        print(f"ratio stream/all_gather throughput = {t_raw / t_stream:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, tp=2, layers=4, hidden=256, vocab=32000, bucket_mb=64.0, repeats=5)
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        bench(args)
        return 0
    from megarl.parallel.launch import run_module

    return run_module(args.tp, "tools.bench.weight_stream", list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
