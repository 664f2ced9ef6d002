"""What a step's rollout data costs each rank as the world grows (CPU, gloo, tiny models).

    .venv/bin/python -m tools.bench.scale [--worlds 2,4,8] [--models moe,vlm_moe] [--modes batch,work]
        [--steps 2] [--json out.json]

For every model x mode x world it runs the RL loop (megarl.trainer.loop.train, builtin engine, no
SFT: the tiny model as built, dynamic sampling off) for --steps steps on that many gloo ranks and
reads, per rank, the bytes megarl's own collectives of the step's data path delivered to it
(megarl.parallel.exchange.traffic: "payload" = trajectories moved to their trainers, "meta" = the
per-sample metadata every rank decides on, "scalars" = per-sample vectors and metric sums) and the
most payload bytes it held at once (its generated rows plus the rows delivered to it).

Mini-batches of --mini-batch samples (2 groups by default): each mixes rows of every rank, so some
rows move to balance the DP ranks' tokens (a row stays where it was generated when the balance
allows: megarl.data.packing.balance_across_dp). With --tp 2 every row also goes to the other TP
rank of its replica, which generated other rows: the payloads the formula column checks.

Models: `moe`, the tiny Qwen3-MoE of configs/quickstart/moe.yaml (EP=2, routing replay: routed
experts travel with every row); `vlm_moe`, the tiny Qwen3-VL-MoE of configs/quickstart/vlm_moe.yaml
(images too). Modes: `batch`, the same global batch at every world (--prompts prompts): per-rank
payload bytes must fall as 1/DP; `work`, the same work per rank (--prompts-per-rank prompts per
rank): per-rank payload bytes stay flat.

The last columns compare each rank's received payload with the planner's formula
(megarl.planner.rollout_data.row_bytes) at the rows' measured mean lengths.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.scale`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tools._options import add_options

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"moe": "configs/quickstart/moe.yaml", "vlm_moe": "configs/quickstart/vlm_moe.yaml"}


def run_overrides(root: Path, model: str, prompts: int, steps: int, max_new: int, mini_batch: int,
                  tp: int = 1) -> list[str]:
    """The RL run of one measurement (no SFT, no eval, no checkpoints, every rank an engine)."""
    return [f"parallel.tp={tp}", *(["parallel.etp=1", "model.sequence_parallel=true"] if tp > 1 else []),f"trainer.run_dir={root / 'run'}", f"model.hf_path={root / model / 'model'}", "model.load=null",
            f"data.train_path={root / model / 'task' / 'train.jsonl'}", "data.eval=[]",
            f"trainer.total_steps={steps}", "trainer.save_interval=0", "trainer.eval_interval=0",
            "trainer.val_before_train=false", "algorithm.dynamic_sampling=false",
            f"rollout.prompts_per_step={prompts}", f"algorithm.mini_batch_size={mini_batch}",
            "rollout.n_samples_per_prompt=4", f"rollout.max_new_tokens={max_new}", "trainer.loggers=[]",
            "algorithm.overlong_penalty=false", "algorithm.overlong_max_len=null"]


def worker(args) -> None:
    """One measurement, on every rank (under torchrun)."""
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.parallel import exchange
    from megarl.trainer.loop import train

    cfg = load_config(str(REPO / CONFIGS[args.model]), run_overrides(Path(args.root), args.model, args.prompts,
                                                                     args.steps, args.max_new_tokens, args.mini_batch,
                                                                     args.tp))
    result = train(cfg)
    stats = {"rows": result["rows"], "traffic": exchange.traffic()}
    parts = exchange.gather_objects(stats)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(parts))


def build_model(root: Path, model: str) -> None:
    """The tiny model and task files of a quickstart config, once."""
    from megarl.config import load_config
    from megarl.quickstart import save_quickstart_model
    from megarl.tasks import quickstart_task

    if (root / model / "task" / "train.jsonl").exists():
        return
    cfg = load_config(str(REPO / CONFIGS[model]), [])
    save_quickstart_model(root / model / "model", cfg)
    quickstart_task(cfg.quickstart.task).write_files(root / model / "task", cfg)


def summarize(parts: list[dict], model: str) -> dict:
    """Per-rank figures of one run: the largest over ranks (the rank a cluster user would watch)."""
    from megarl.planner.rollout_data import row_bytes
    from megarl.config import load_config

    cfg = load_config(str(REPO / CONFIGS[model]), [])
    received = [sum(ph.get("payload", 0) for ph in p["traffic"].values()) for p in parts]
    out = {
        "payload_bytes": max(received),
        "meta_bytes": max(sum(ph.get("meta", 0) for ph in p["traffic"].values()) for p in parts),
        "scalar_bytes": max(sum(ph.get("scalars", 0) for ph in p["traffic"].values()) for p in parts),
        "held_peak_bytes": max(p["rows"]["held_peak_bytes"] for p in parts),
    }
    predicted = []
    for p, got in zip(parts, received):
        r = p["rows"]
        n = r["trained_rows"] - r["own_rows"]  # rows delivered to this rank by another one
        if n:
            prompt, response = r["trained_prompt_tokens"] / r["trained_rows"], r["trained_response_tokens"] / r["trained_rows"]
            predicted.append((got, n * row_bytes(prompt, response, r["moe_layers"], cfg.quickstart.moe_topk, 1,
                                                 image_bytes=r["image_bytes"] / r["trained_rows"])))
    out["formula_ratio"] = max(abs(p / g - 1) for g, p in predicted) if predicted else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, worlds="2,4,8", models="moe,vlm_moe", modes="batch,work", steps=2, prompts=8,
                prompts_per_rank=2, max_new_tokens=12, mini_batch=8, tp=1, json="", root="", out="", model="moe",
                worker=False)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from megarl.parallel.launch import run_module

    root = Path(args.root or tempfile.mkdtemp(prefix="megarl_scale_"))
    rows = []
    print(f"tp={args.tp}")
    print(f"{'model':<8} {'mode':<6} {'world':>5} {'prompts':>7} {'payload/rank':>13} {'meta/rank':>10} "
          f"{'scalars/rank':>12} {'held peak':>10} {'formula':>8}", flush=True)
    for model in args.models.split(","):
        build_model(root, model)
        for mode in args.modes.split(","):
            for world in map(int, args.worlds.split(",")):
                prompts = args.prompts if mode == "batch" else args.prompts_per_rank * world
                out = root / f"{model}_{mode}_{world}.json"
                rc = run_module(world, "tools.bench.scale", [
                    "--worker", "true", "--model", model, "--root", str(root), "--out", str(out),
                    "--prompts", str(prompts), "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
                    "--mini-batch", str(args.mini_batch), "--tp", str(args.tp)],
                    env=dict(os.environ, PYTHONWARNINGS="ignore"))
                if rc != 0:
                    print(f"{model} {mode} world {world}: the run failed (exit {rc})", file=sys.stderr)
                    return rc
                s = summarize(json.loads(out.read_text()), model)
                rows.append({"model": model, "mode": mode, "world": world, "prompts": prompts, **s})
                print(f"{model:<8} {mode:<6} {world:>5} {prompts:>7} {s['payload_bytes']:>13,} {s['meta_bytes']:>10,} "
                      f"{s['scalar_bytes']:>12,} {s['held_peak_bytes']:>10,} {s['formula_ratio']:>7.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
