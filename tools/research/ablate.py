"""Ablation tables at toy scale: a method and its ablations on the quickstart task over seeds.

    python -m tools.research.ablate --method vapo --seeds 1 2 3            # runs, then prints the table
    python -m tools.research.ablate --method dapo --dry-run                 # prints the commands only
    python -m tools.research.ablate --method vapo --table-only              # table from finished runs

Every run is `megarl quickstart --config <preset> trainer.run_dir=<root>/<method>/<variant>/seed<N>
trainer.seed=<N> <overrides>`. Its run dir is seeded first with a finished SFT (tiny_model/, task/,
megatron_init/, sft_actor/ of --sft-from, default runs/qs_dapo), so every variant and seed starts
from the same SFT checkpoint and task and only the RL phase differs (and is timed). A finished
run (its metrics.jsonl holds the last step's eval and `ablate_wall.json` exists) is not re-run.

Table: per variant, mean ± std over seeds (sample std, n-1; 0 for one seed) of the final greedy
accuracy (eval/accuracy at the last step), the best greedy accuracy (max over the evals after
step 0), the critic's explained variance (after value pretraining; mean over the policy steps),
the sum of the RL steps' `time/step` and the quickstart's wall time.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.ablate`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT_DIRS = ("tiny_model", "task", "megatron_init", "sft_actor")
WALL_FILE = "ablate_wall.json"


@dataclass(frozen=True)
class Variant:
    name: str
    config: str
    overrides: tuple[str, ...] = ()


_VAPO, _DAPO = "configs/quickstart/vapo.yaml", "configs/quickstart/dapo.yaml"
# one sample per prompt, as many samples per step as the preset's 32 x 8
_NO_GROUPS = ("rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=256")
METHODS: dict[str, list[Variant]] = {
    "vapo": [
        Variant("VAPO", _VAPO),
        # as many policy steps as VAPO (40) without the critic-only steps before them
        Variant("w/o value pretraining", _VAPO, ("algorithm.value_pretrain_steps=0",
                                                 "algorithm.value_pretrain_ev_target=null", "trainer.total_steps=40")),
        Variant("w/o decoupled GAE", _VAPO, ("algorithm.lam_critic=0.95",)),
        Variant("w/o length-adaptive GAE", _VAPO, ("algorithm.length_adaptive_alpha=null", "algorithm.lam_actor=0.95")),
        Variant("w/o clip-higher", _VAPO, ("algorithm.clip_high=0.2",)),
        Variant("w/o token-level loss", _VAPO, ("algorithm.loss_agg=seq-mean-token-mean",)),
        Variant("w/o positive-example LM loss", _VAPO, ("algorithm.pos_lm_coef=0.0",)),
        Variant("w/o group sampling", _VAPO, _NO_GROUPS),
    ],
    "dapo": [
        Variant("DAPO", _DAPO),
        Variant("w/o clip-higher", _DAPO, ("algorithm.clip_high=0.2",)),
        Variant("w/o dynamic sampling", _DAPO, ("algorithm.dynamic_sampling=false",)),
        Variant("w/o token-level loss", _DAPO, ("algorithm.loss_agg=seq-mean-token-mean",)),
        Variant("w/o overlong shaping", _DAPO, ("algorithm.overlong_penalty=false",)),
    ],
    "ppo": [
        Variant("PPO", "configs/quickstart/ppo.yaml"),
        Variant("VC-PPO", "configs/quickstart/vc_ppo.yaml"),
    ],
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def run_dir(root: Path, method: str, variant: Variant, seed: int) -> Path:
    return root / method / slug(variant.name) / f"seed{seed}"


def command(variant: Variant, run: Path, seed: int) -> list[str]:
    megarl = Path(sys.executable).with_name("megarl")
    return [str(megarl), "quickstart", "--config", variant.config, f"trainer.run_dir={run}", f"trainer.seed={seed}",
            *variant.overrides]


# ---- aggregation (pure: reads files, no runs) ---------------------------------------------------
def summarize_run(run: Path) -> dict | None:
    """{final, best, wall_s, step_s, ev_pretrain, ev_policy} of a finished run dir, None if it has
    not finished. final: the last eval/accuracy row's value (the row of the largest step); best: max
    over evals after step 0; step_s: the sum of `time/step` (the RL steps' own time, value
    pretraining included); ev_pretrain: `critic/explained_variance` at the last value-pretraining
    step; ev_policy: its mean over the policy steps (None where the run has no such rows)."""
    metrics, wall = run / "metrics.jsonl", run / WALL_FILE
    if not metrics.exists() or not wall.exists():
        return None
    evals: dict[int, float] = {}
    step_s, pre, pol = [], [], []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short
            continue
        if row.get("eval/accuracy") is not None:
            evals[int(row["step"])] = float(row["eval/accuracy"])
        if row.get("time/step") is not None:
            step_s.append(float(row["time/step"]))
        if row.get("critic/explained_variance") is not None:
            (pre if row.get("critic/pretraining") else pol).append(float(row["critic/explained_variance"]))
    after = {s: v for s, v in evals.items() if s > 0}
    if not after:
        return None
    return {"final": after[max(after)], "best": max(after.values()),
            "wall_s": float(json.loads(wall.read_text())["wall_s"]), "step_s": sum(step_s) if step_s else None,
            "ev_pretrain": pre[-1] if pre else None, "ev_policy": sum(pol) / len(pol) if pol else None}


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0.0 for a single value)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


COLUMNS = ("final", "best", "ev_pretrain", "ev_policy", "step_s", "wall_s")


def aggregate(summaries: dict[str, list[dict]]) -> list[dict]:
    """variant -> its runs' summaries -> one row per variant (in the given order) with n and
    (mean, std) of every column over the runs that have it (None where none has it); variants
    without a finished run are left out."""
    rows = []
    for name, runs in summaries.items():
        if runs:
            row = {"variant": name, "n": len(runs), "seeds": [r["seed"] for r in runs if "seed" in r]}
            for k in COLUMNS:
                xs = [r[k] for r in runs if r.get(k) is not None]
                row[k] = mean_std(xs) if xs else None
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def cell(ms, fmt):
        return "-" if ms is None else f"{ms[0]:{fmt}} ± {ms[1]:{fmt}}"

    head = ["| variant | seeds | final greedy acc | best greedy acc | critic EV after value pretraining | "
            "critic EV, mean over policy steps | RL step time s (sum) | wall s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    body = [f"| {r['variant']} | {r['n']} ({','.join(str(s) for s in r['seeds'])}) | {cell(r['final'], '.3f')} | "
            f"{cell(r['best'], '.3f')} | {cell(r['ev_pretrain'], '.3f')} | {cell(r['ev_policy'], '.3f')} | "
            f"{cell(r['step_s'], '.0f')} | {cell(r['wall_s'], '.0f')} |" for r in rows]
    return "\n".join(head + body)


# ---- running --------------------------------------------------------------------------------------
def seed_run_dir(run: Path, sft_from: Path) -> None:
    for name in SFT_DIRS:
        src, dst = sft_from / name, run / name
        if src.exists() and not dst.exists():
            shutil.copytree(src, dst)


def run_one(variant: Variant, run: Path, seed: int, sft_from: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    seed_run_dir(run, sft_from)
    t0 = time.perf_counter()
    rc = subprocess.call(command(variant, run, seed), cwd=REPO)
    if rc != 0:
        raise SystemExit(f"ablate: {variant.name} seed {seed} failed (rc={rc}); run dir {run}")
    (run / WALL_FILE).write_text(json.dumps({"wall_s": time.perf_counter() - t0}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=sorted(METHODS), required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                   help="trainer.seed values (the quickstart's default is 1)")
    p.add_argument("--variants", nargs="*", help="variant names (default: all of the method's)")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "ablate")
    p.add_argument("--sft-from", type=Path, default=REPO / "runs" / "qs_dapo")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--table-only", action="store_true", help="print the table of the finished runs")
    a = p.parse_args(argv)
    variants = [v for v in METHODS[a.method] if not a.variants or v.name in a.variants]
    if a.variants and len(variants) != len(a.variants):
        raise SystemExit(f"ablate: unknown variant among {a.variants}; {a.method} has "
                         f"{[v.name for v in METHODS[a.method]]}")
    summaries: dict[str, list[dict]] = {}
    for v in variants:
        summaries[v.name] = []
        for seed in a.seeds:
            run = run_dir(a.root, a.method, v, seed)
            if a.dry_run:
                print(" ".join(command(v, run, seed)))
                continue
            if not a.table_only and summarize_run(run) is None:
                run_one(v, run, seed, a.sft_from)
            s = summarize_run(run)
            if s is not None:
                summaries[v.name].append({**s, "seed": seed})
    if not a.dry_run:
        print(format_table(aggregate(summaries)))


if __name__ == "__main__":
    main()
