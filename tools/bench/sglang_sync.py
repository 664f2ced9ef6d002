"""Weight-sync time: the trainer's weights streamed into the rollout engine, as the colocated loop does.

    python -m tools.bench.sglang_sync --shapes 0.5b,1.5b --engine sglang --server-arg attention_backend=triton
    python -m tools.bench.sglang_sync --shapes tiny --engine builtin          # CPU: the same loop, builtin engine

Per shape (tools/bench/train.py's Qwen2.5 shapes, random weights): a trainer model (TE spec where
importable, bf16 on a GPU) and an engine started from the shape's config.json only
(`load_format="dummy"`: no weights on disk; the builtin engine starts empty). Then `--repeats`
times the colocated cycle of `megarl.trainer.components`: engine memory released -> weights region
resumed -> `engine.update_weights(stream_hf_weights(...))` -> the rest resumed; the first update is
a warm-up. Reported: the update's median seconds and GB/s (bf16 bytes of the HF tensors), the
release / resume times, and a greedy generation before and after a sync to the same weights, which
must agree (the sync delivered them). NeMo-RL reports 0.74-1.0 s to refit a 30B model.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.sglang_sync`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools._options import key_values


def parse_server_args(items: list[str] | None) -> dict:
    """--server-arg KEY=VALUE strings -> engine keywords (VALUE parsed as JSON when it is JSON)."""
    return key_values(items, "--server-arg")


def engine_kwargs(kind: str, model_dir: Path, mem_fraction: float, server_args: dict) -> dict:
    """make_engine keywords for `kind` (the builtin engine takes none of SGLang's)."""
    if kind == "builtin":
        return {}
    return {"model_path": str(model_dir), "load_format": "dummy", "dtype": "bfloat16",
            "mem_fraction_static": mem_fraction, "random_seed": 0, **server_args}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def measure(shape: str, kind: str, repeats: int, bucket_mb: int, mem_fraction: float, server_args: dict,
            work: Path) -> dict:
    import torch

    from megarl.models.builder import te_available
    from megarl.parallel.distributed import device
    from megarl.rollout.registry import make_engine
    from megarl.rollout.types import SamplingParams
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import stream_hf_weights
    from tools.bench.train import hf_config

    cuda = torch.cuda.is_available()
    cfg = hf_config(shape, 4096)
    model_dir = work / shape
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(model_dir)
    trainer = TrainModel(cfg, None, dtype="bf16" if cuda else "fp32",
                         impl="transformer_engine" if cuda and te_available() else "local", seed=0)
    dtype = torch.bfloat16 if cuda else torch.float32
    if kind == "builtin":
        engine = make_engine("builtin", config=cfg, tokenizer=None, device=device(), dtype=dtype)
    else:
        engine = make_engine(kind, **engine_kwargs(kind, model_dir, mem_fraction, server_args))
    nbytes = sum(p.numel() for m in trainer.modules for p in m.parameters()) * 2
    update = lambda: engine.update_weights(stream_hf_weights(trainer.modules, cfg, bucket_mb << 20, dtype=dtype))  # noqa: E731
    tags = (lambda t: {"tags": t}) if kind == "sglang" else (lambda t: {})
    row = {"shape": shape, "engine": kind, "weights_gb": nbytes / 1e9, "bucket_mb": bucket_mb}
    try:
        row["start_s"] = _timed(lambda: getattr(engine, "start", lambda: None)())
        row["first_update_s"] = _timed(update)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        prompts = [[11, 12, 13, 14], [100, 200, 300]]
        before = [s.response_ids for s in engine.generate(prompts, greedy)]
        updates, releases, resumes = [], [], []
        for _ in range(repeats):
            releases.append(_timed(lambda: engine.release_memory()))
            resumes.append(_timed(lambda: engine.resume_memory(**tags(["weights"]))))
            updates.append(_timed(update))
            resumes[-1] += _timed(lambda: engine.resume_memory())
        after = [s.response_ids for s in engine.generate(prompts, greedy)]
        median = statistics.median(updates)
        row.update(update_s=median, update_all_s=updates, gb_per_s=nbytes / 1e9 / median,
                   release_s=statistics.median(releases), resume_s=statistics.median(resumes),
                   greedy_same=before == after, status="ok" if before == after else
                   "FAIL: greedy output changed after syncing the same weights")
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--engine", default="sglang", choices=["sglang", "builtin"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--server-arg", action="append", help="further sglang.Engine keyword KEY=VALUE (repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tools.bench.train import SHAPES

    bad = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if bad:
        p.error(f"unknown shapes {bad} (choose from {sorted(SHAPES)})")
    args.server_args = parse_server_args(args.server_arg)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server_args = args.server_args
    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as work:
        for shape in [s for s in args.shapes.split(",") if s]:
            try:
                rows.append(measure(shape, args.engine, args.repeats, args.bucket_mb, args.mem_fraction, server_args,
                                    Path(work)))
            except Exception as err:  # noqa: BLE001 - reported; the next shape runs
                rows.append({"shape": shape, "engine": args.engine, "status": f"error: {type(err).__name__}: {str(err)[:300]}"})
            print("weight_sync " + json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    destroy_distributed()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
