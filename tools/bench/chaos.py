"""Fault injection: kill a small RL job at random moments, resume it, prove nothing was lost.

    python -m tools.bench.chaos --trials 50 [--steps 3] [--workdir runs/chaos] [--seed 0] [--json out.json]

The job is the CPU quickstart (`megarl quickstart`: the tiny model and arithmetic task, 2 gloo
ranks, TP=2) shrunk to a 2-step SFT and `--steps` RL steps with a checkpoint after every step.

1. reference: the job run once, uninterrupted (it also builds the model, task, Megatron
   conversion and SFT that the trials reuse);
2. every trial runs the same command with trainer.resume=true in a fresh run dir (seeded with the
   reference's tiny_model/, task/, megatron_init/, sft_actor/, except for trials that kill the
   conversion or the SFT), kills it once, and runs the command again. Kills:
   - phase:   rank 0 SIGKILLs every process of the job at the n-th entry of a phase
              (MEGARL_CHAOS_KILL_AT=<phase>:<n>@0:node, megarl/parallel/distributed.py);
   - rank:    one rank SIGKILLs itself at a phase (MEGARL_CHAOS_KILL_AT=<phase>:<n>@<r>);
              torchrun ends the other;
   - time:    this tool SIGKILLs every process of the job a random time into its RL phase
              (uniform over the RL phase's duration in an uninterrupted trial-shaped run);
   - time-rank: this tool SIGKILLs one rank a random time into the RL phase.
   n is drawn from the entries the reference logged (MEGARL_CHAOS_LOG). A time kill is
   classified by the phase the killed rank had logged last. Every third trial saves with
   trainer.async_save=true.
3. checks per trial: after the kill every checkpoint at or below `latest` is complete
   (megarl.trainer.checkpoint.checkpoint_problems: trainer_state.pt, every torch_dist file and
   shard size); the resumed run exits 0 with the reference's final line (wall_s aside); every
   metrics.jsonl row either attempt logged equals the reference's row for that step (time/perf
   keys aside); every step's trainer_state.pt (data position, RNG, KL, carried groups) equals
   the reference's, so no data position was skipped or repeated.

Prints one line per trial and a summary: trials, kills by phase, unloadable checkpoints, metric
and data mismatches, failures. Exits 1 on any failure or a required phase without a kill.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.chaos`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

REQUIRED = ("rollout", "reward", "update", "checkpoint_write", "latest_update")
HOOKED = {"update": "actor_update"}  # reported phase -> the phase name megarl logs
EXTRA_HOOKS = ("prepare", "weight_sync", "eval", "sft", "convert")
UNSEEDED = ("sft", "convert")  # trials that kill these start without the reference's outputs
SEEDED = ("tiny_model", "task", "megatron_init", "sft_actor")
VOLATILE = ("time/", "perf/", "reward/time_s")
FINAL = re.compile(r"^quickstart: accuracy_before=(\S+) accuracy_after=(\S+) wall_s=\S+ run_dir=\S+$", re.M)


def job_overrides(steps: int) -> list[str]:
    return ["sft.max_steps=2", f"trainer.total_steps={steps}", "trainer.save_interval=1", "trainer.keep_last=null",
            "trainer.eval_interval=0", "algorithm.dynamic_sampling=false", "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4", "algorithm.mini_batch_size=16"]


@dataclass
class Attempt:
    rc: int
    output: str
    seconds: float
    killed_phase: str | None = None
    rl_seconds: float | None = None  # from the start of the RL phase to the end


@dataclass
class Trial:
    index: int
    kind: str
    phase: str  # the reported phase of the kill
    rank: int | None = None
    async_save: bool = False
    detail: str = ""
    problems: dict = field(default_factory=dict)  # category -> list of messages


def report_phase(logged: str) -> str:
    return "update" if logged in ("actor_update", "critic_update") else logged


# ---- running the job ---------------------------------------------------------------------------
def job_processes(tag: str):
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MEGARL_CHAOS_TRIAL") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_processes(procs) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def rank_process(tag: str, rank: int):
    """The torchrun worker of `rank` (not its forked writers / helper processes)."""
    import psutil

    for p in job_processes(tag):
        try:
            if p.environ().get("RANK") == str(rank) and "torch.distributed.run" in " ".join(p.parent().cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    return None


def last_phase(log_prefix: Path, rank: int) -> str | None:
    lines = log_lines(log_prefix, rank)
    if not lines:
        return "startup"
    words = lines[-1].split()
    return " ".join(words[:-1] if words[-1].isdigit() else words)


def run_job(run_dir: Path, steps: int, env_extra: dict, timeout: float, extra: list[str] = (),
            kill_after: float | None = None, kill_rank: int | None = None, attempt: str = "a") -> Attempt:
    """The quickstart command (trainer.resume=true); with `kill_after`, SIGKILL of the whole job
    (or of `kill_rank`) that many seconds after its RL phase began (rank 0 logged "rl 1")."""
    tag = uuid.uuid4().hex
    log_prefix = run_dir / f"phases.{attempt}"
    env = dict(os.environ, MEGARL_CHAOS_TRIAL=tag, MEGARL_CHAOS_LOG=str(log_prefix), PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "megarl.cli", "quickstart", f"trainer.run_dir={run_dir}", "trainer.resume=true",
           *job_overrides(steps), *extra]
    out_path = run_dir.parent / f"{run_dir.name}.{attempt}.log"
    t0 = time.monotonic()
    t_rl = killed = None
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 > timeout:
                    out.write(f"\nchaos: the job did not end within {timeout:.0f} s; killed\n")
                    break
                if t_rl is None and "rl 1" in log_lines(log_prefix, 0):
                    t_rl = now
                if kill_after is not None and killed is None and t_rl is not None and now - t_rl >= kill_after:
                    killed = kill_job(tag, log_prefix, kill_rank)
                time.sleep(0.05)
        finally:
            kill_processes(job_processes(tag))  # a hung job, orphans (async checkpoint writers of a killed rank)
            proc.wait()
    end = time.monotonic()
    return Attempt(proc.returncode, out_path.read_text(), end - t0, killed, end - t_rl if t_rl else None)


def log_lines(log_prefix: Path, rank: int) -> list[str]:
    path = Path(f"{log_prefix}.rank{rank}")
    return path.read_text().splitlines() if path.exists() else []


def kill_job(tag: str, log_prefix: Path, rank: int | None) -> str | None:
    """SIGKILLs every process of the job (rank None) or the worker of `rank`; returns the phase
    the killed rank had logged last (None when there was nothing to kill)."""
    if rank is None:
        killed = last_phase(log_prefix, 0)
        kill_processes(job_processes(tag))
        return killed
    target = rank_process(tag, rank)
    if target is None:
        return None
    killed = last_phase(log_prefix, rank)
    target.kill()
    return killed


# ---- checks --------------------------------------------------------------------------------------
def checkpoint_failures(run_dir: Path) -> list[str]:
    """Problems of the checkpoints resume could load: `latest` and every step at or below it."""
    from megarl.trainer.checkpoint import checkpoint_problems, read_latest

    try:
        latest = read_latest(run_dir)
    except (ValueError, OSError) as e:
        return [f"latest: {e}"]
    if latest is None:
        return []
    top = int(latest.name.split("_")[1])
    out = []
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        if int(path.name.split("_")[1]) <= top:
            out += checkpoint_problems(path)
    return out


def metric_rows(path: Path) -> list[tuple[tuple, dict]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            rows.append((("torn line",), {"line": line[:80]}))
            continue
        key = (r["step"], "eval" if "eval/accuracy" in r else "train")
        rows.append((key, {k: v for k, v in r.items() if not k.startswith(VOLATILE)}))
    return rows


def metric_mismatches(run_dir: Path, ref_dir: Path) -> list[str]:
    ref = dict(metric_rows(ref_dir / "metrics.jsonl"))
    got = metric_rows(run_dir / "metrics.jsonl")
    out = [f"{key}: never logged" for key in ref if key not in dict(got)]
    for key, row in got:
        if row != ref.get(key):
            diff = {k: (ref.get(key, {}).get(k), row.get(k)) for k in set(row) | set(ref.get(key, {}))
                    if row.get(k) != ref.get(key, {}).get(k)}
            out.append(f"{key}: differs {dict(list(diff.items())[:4])}")
    return out


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def data_mismatches(run_dir: Path, ref_dir: Path, steps: int) -> list[str]:
    """Every step's trainer state (data position, RNG, KL, carried groups) equals the reference's."""
    from megarl.trainer.checkpoint import load_trainer_state, step_dir

    out = []
    for step in range(1, steps + 1):
        mine, ref = step_dir(run_dir, step), step_dir(ref_dir, step)
        if not (mine / "trainer_state.pt").exists():
            out.append(f"step {step}: no trainer_state.pt")
            continue
        a, b = load_trainer_state(mine), load_trainer_state(ref)
        if not _same(a, b):
            keys = [k for k in b if not _same(a.get(k), b[k])]
            out.append(f"step {step}: trainer state differs in {keys} (data {a.get('data')} vs {b.get('data')})")
    return out


# ---- trials --------------------------------------------------------------------------------------
def phase_entries(log_prefix: Path, rank: int) -> dict[str, list[tuple[int, str]]]:
    """phase -> [(n, parent phase)] of every entry rank `rank` logged."""
    entries: dict[str, list[tuple[int, str]]] = {}
    current = "startup"
    for line in Path(f"{log_prefix}.rank{rank}").read_text().splitlines():
        words = line.split()
        if words[-1].isdigit():
            name = " ".join(words[:-1])
            entries.setdefault(name, []).append((int(words[-1]), current))
            current = name
        else:
            current = line
    return entries


def plan(i: int, rng: random.Random, counters: Counter) -> tuple[str, str, int | None]:
    """(kind, reported phase or '', rank) of trial i: the first five kill each required phase by
    hook (whole job / one rank alternating), then time / hook / time-rank / rank-hook in turn."""
    if i < len(REQUIRED):
        return ("phase", REQUIRED[i], None) if i % 2 == 0 else ("rank", REQUIRED[i], (i // 2) % 2)
    kind = ("time", "phase", "time-rank", "rank")[(i - len(REQUIRED)) % 4]
    if kind.startswith("time"):
        return kind, "", (rng.randrange(2) if kind == "time-rank" else None)
    hooks = REQUIRED + EXTRA_HOOKS
    name = hooks[counters[kind] % len(hooks)]
    counters[kind] += 1
    return kind, name, (rng.randrange(2) if kind == "rank" else None)


def fresh_run_dir(run_dir: Path, ref_dir: Path, seeded: bool) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for name in SEEDED if seeded else ():
        shutil.copytree(ref_dir / name, run_dir / name)


def run_trial(i: int, args, ref_dir: Path, ref_entries: list, trial_seconds: float, rng: random.Random,
              counters: Counter) -> Trial:
    kind, phase, rank = plan(i, rng, counters)
    trial = Trial(i, kind, phase, rank, async_save=i % 3 == 2)
    run_dir = args.workdir / f"trial_{i:03d}"
    extra = ["trainer.async_save=true"] if trial.async_save else []
    if kind.startswith("time"):
        kill_after = rng.uniform(0.0, 1.0) * trial_seconds
        for _ in range(4):  # a run faster than the calibration one may finish first: kill earlier
            fresh_run_dir(run_dir, ref_dir, seeded=True)
            first = run_job(run_dir, args.steps, {}, args.timeout, extra, kill_after,
                            rank if kind == "time-rank" else None)
            if first.killed_phase is not None:
                break
            kill_after /= 2
        trial.detail = f"{kill_after:.1f} s into RL"
        trial.phase = report_phase(first.killed_phase) if first.killed_phase else "none"
        if first.killed_phase is None:
            trial.problems["no kill"] = ["the job finished before every kill time"]
    else:
        logged = HOOKED.get(phase, phase)
        choices = [n for n, parent in ref_entries[rank or 0].get(logged, [])
                   if not (logged == "reward" and parent != "rollout")]  # the RL reward, not eval's
        spec = f"{logged}:{rng.choice(choices)}@{rank or 0}" + (":node" if kind == "phase" else "")
        trial.detail = spec
        fresh_run_dir(run_dir, ref_dir, seeded=phase not in UNSEEDED)
        first = run_job(run_dir, args.steps, {"MEGARL_CHAOS_KILL_AT": spec}, args.timeout, extra)
        if "MEGARL_CHAOS_KILL_AT:" not in first.output or first.rc == 0:
            trial.problems["no kill"] = [f"the hook {spec} never fired (rc={first.rc})"]
    trial.problems["unloadable checkpoints"] = checkpoint_failures(run_dir)
    second = run_job(run_dir, args.steps, {}, args.timeout, extra, attempt="b")
    ref_final, final = FINAL.search(args.ref_output), FINAL.search(second.output)
    if second.rc != 0 or final is None:
        trial.problems["resume failed"] = [f"rc={second.rc}: {second.output[-1500:]}"]
    elif final.groups() != ref_final.groups():
        trial.problems["metric mismatches"] = [f"final line {final.group(0)} vs {ref_final.group(0)}"]
    trial.problems.setdefault("metric mismatches", []).extend(metric_mismatches(run_dir, ref_dir))
    trial.problems["data mismatches"] = data_mismatches(run_dir, ref_dir, args.steps)
    trial.problems = {k: v for k, v in trial.problems.items() if v}
    if not trial.problems and not args.keep:
        shutil.rmtree(run_dir)
    return trial


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--steps", type=int, default=3, help="RL steps of the job (a checkpoint after each)")
    p.add_argument("--workdir", type=Path, default=REPO / "runs" / "chaos")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (the job's seed is fixed)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a job counts as hung")
    p.add_argument("--keep", action="store_true", help="keep the run dirs of passing trials")
    p.add_argument("--json", type=Path, help="write the summary and every trial here")
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    rng, counters = random.Random(args.seed), Counter()

    ref_dir = args.workdir / "reference"
    ref_dir.mkdir()
    ref = run_job(ref_dir, args.steps, {}, args.timeout)
    if ref.rc != 0 or not FINAL.search(ref.output):
        print(f"chaos: the reference run failed (rc={ref.rc}):\n{ref.output[-3000:]}")
        return 1
    args.ref_output = ref.output
    ref_entries = [phase_entries(ref_dir / "phases.a", r) for r in (0, 1)]
    needs_timing = any(plan(i, random.Random(0), Counter())[0].startswith("time") for i in range(args.trials))
    trial_seconds = ref.seconds
    if needs_timing:  # an uninterrupted trial-shaped run: the time kills' range (and one more equality check)
        calib = args.workdir / "calibration"
        calib.mkdir()
        for name in SEEDED:
            shutil.copytree(ref_dir / name, calib / name)
        timed = run_job(calib, args.steps, {}, args.timeout)
        problems = metric_mismatches(calib, ref_dir) + data_mismatches(calib, ref_dir, args.steps)
        if timed.rc != 0 or problems:
            print(f"chaos: the seeded uninterrupted run differs from the reference: {problems[:5]} rc={timed.rc}")
            return 1
        trial_seconds = timed.rl_seconds
    print(f"chaos: reference {FINAL.search(ref.output).group(0)!r} in {ref.seconds:.1f} s; "
          f"RL phase of a trial-shaped run {trial_seconds:.1f} s", flush=True)

    trials = []
    for i in range(args.trials):
        t0 = time.monotonic()
        t = run_trial(i, args, ref_dir, ref_entries, trial_seconds, rng, counters)
        trials.append(t)
        status = "ok" if not t.problems else "FAIL " + "; ".join(f"{k}: {v[:2]}" for k, v in t.problems.items())
        print(f"trial {i:3d}: {t.kind:9s} {t.phase:16s} {t.detail:34s} async={int(t.async_save)} "
              f"{time.monotonic() - t0:5.1f} s  {status}", flush=True)

    kills = Counter(t.phase for t in trials)
    count = lambda cat: sum(len(t.problems.get(cat, [])) for t in trials)  # noqa: E731
    summary = {"trials": len(trials), "kills_by_phase": dict(sorted(kills.items())),
               "kills_by_kind": dict(Counter(t.kind for t in trials)),
               "async_save_trials": sum(t.async_save for t in trials),
               "unloadable_checkpoints": count("unloadable checkpoints"),
               "metric_mismatches": sum(bool(t.problems.get("metric mismatches")) for t in trials),
               "data_mismatches": sum(bool(t.problems.get("data mismatches")) for t in trials),
               "failures": sum(bool(t.problems) for t in trials),
               "missing_phases": [ph for ph in REQUIRED if not kills.get(ph)]}
    print("chaos: " + " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in summary.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "trials": [t.__dict__ for t in trials]}, indent=1))
    return 1 if summary["failures"] or summary["missing_phases"] else 0


if __name__ == "__main__":
    sys.exit(main())
