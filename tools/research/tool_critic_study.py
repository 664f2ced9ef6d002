"""The critic on a task it can read (docs/tools.md, "The critic study"): the ReTool preset (PPO with a
critic) and VAPO against GRPO and DAPO on the tool quickstart's task, from one SFT checkpoint,
several RL seeds each; the critic's explained variance and the greedy accuracy / tool-call rate.

    python -m tools.research.tool_critic_study --base runs/quickstart_tools [--seeds 1 2 3]
        [--algorithms retool vapo grpo dapo] [--steps 16] [--out runs/tool_critic_study]

--base is a finished tool quickstart run dir (`megarl quickstart --config configs/quickstart/tools.yaml`):
its tiny model, task files and SFT checkpoint are the start of every run. Each (algorithm, seed)
runs `megarl train` on 2 gloo ranks (TP=2) with the algorithm's quickstart preset composed with
configs/quickstart/tool_task.yaml, the tool quickstart's batch (16 prompts x 8 samples, mini-batch
64) and --steps policy steps (VAPO: plus its value-pretraining steps), evaluating greedily before
and after. A run that fails (e.g. DAPO's dynamic sampling running out of mixed groups once the
task is solved) is reported with its error. Writes <out>/summary.json and prints a table:
accuracy after RL, call rate after RL, the critic's mean explained variance over the policy steps
(critic runs) and its last value.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.tool_critic_study`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESETS = {"retool": "configs/quickstart/tools.yaml", "vapo": "configs/quickstart/vapo.yaml",
           "grpo": "configs/quickstart/grpo.yaml", "dapo": "configs/quickstart/dapo.yaml", "ppo": "configs/quickstart/ppo.yaml"}
BATCH = ["rollout.prompts_per_step=16", "rollout.n_samples_per_prompt=8", "algorithm.mini_batch_size=64"]


def run_one(base: Path, out: Path, algorithm: str, seed: int, steps: int, nproc: int) -> dict:
    from megarl.config import load_config

    configs = [PRESETS[algorithm]] + ([] if algorithm == "retool" else ["configs/quickstart/tool_task.yaml"])
    cfg = load_config([str(REPO / c) for c in configs], BATCH)
    total = steps + cfg.algorithm.value_pretrain_steps
    run_dir = out / f"{algorithm}_seed{seed}"
    task = base / "task"
    extra = ["rollout.gen_batch_prompts=24"] if cfg.algorithm.dynamic_sampling else []
    overrides = BATCH + extra + [
        f"model.hf_path={base / 'tiny_model'}", f"model.load={json.loads((base / 'sft_actor/sft_done.json').read_text())['checkpoint']}",
        f"data.train_path={task / 'train.jsonl'}", f"data.eval=[{{path: {task / 'eval.jsonl'}, name: tool_mul}}]",
        f"trainer.run_dir={run_dir}", f"trainer.seed={seed}", f"trainer.total_steps={total}", "trainer.val_before_train=true",
        f"trainer.eval_interval={total}", "trainer.save_interval=0", "trainer.tensorboard=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "megarl.cli", "train",
           *[a for c in configs for a in ("--config", str(REPO / c))], *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    evals = [r for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "critic/explained_variance" in r and not r.get("critic/pretraining")]
    ev = [r["critic/explained_variance"] for r in train]
    result = {"algorithm": algorithm, "seed": seed, "ok": proc.returncode == 0, "steps": total,
              "before": evals[0]["eval/accuracy"] if evals else None,
              "after": evals[-1]["eval/accuracy"] if len(evals) > 1 else None,
              "call_rate_after": evals[-1].get("eval/tool_mul/tools/call_rate") if len(evals) > 1 else None,
              "ev_mean": statistics.fmean(ev) if ev else None, "ev_last": ev[-1] if ev else None,
              "wall_s": sum(r.get("time/step", 0.0) for r in rows)}
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        lines = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        result["error"] = (lines[-1] if lines else text[-500:]).strip()[:300]
    return result


def fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="a finished tool quickstart run dir (its SFT is the start)")
    ap.add_argument("--out", type=Path, default=Path("runs/tool_critic_study"))
    ap.add_argument("--algorithms", nargs="+", default=["retool", "vapo", "grpo", "dapo"], choices=sorted(PRESETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=16, help="policy steps per run")
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    base, out = a.base.resolve(), a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    results = json.loads(summary_path.read_text()) if summary_path.exists() else []
    done = {(r["algorithm"], r["seed"]) for r in results if r["ok"]}
    for algorithm in a.algorithms:
        for seed in a.seeds:
            if (algorithm, seed) in done:
                continue
            r = run_one(base, out, algorithm, seed, a.steps, a.nproc)
            results = [x for x in results if (x["algorithm"], x["seed"]) != (algorithm, seed)] + [r]
            summary_path.write_text(json.dumps(results, indent=1))
            print(json.dumps(r), flush=True)
    print("| algorithm | seed | greedy accuracy before -> after | call rate after | critic EV mean (last) | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in sorted(results, key=lambda r: (a.algorithms.index(r["algorithm"]) if r["algorithm"] in a.algorithms else 99, r["seed"])):
        ev = f"{fmt(r['ev_mean'])} ({fmt(r['ev_last'])})" if r["ev_mean"] is not None else "-"
        print(f"| {r['algorithm']} | {r['seed']} | {fmt(r['before'])} -> {fmt(r['after'])} | {fmt(r['call_rate_after'])} "
              f"| {ev} | {r.get('error', '')} |")


if __name__ == "__main__":
    main()
