"""Mutation check of the config-liveness harness (tests/unit/test_config_liveness.py).

A liveness witness is worth something only if it fails when the code stops using its field. For
each field witnessed through a whole RL run (scripts_liveness.obs_loop / obs_run_dir), this
script edits a scratch copy of the repository so that the field has no effect (loop.py logging
every step whatever trainer.log_interval says, checkpoints never pruned, ...), runs that field's
witness test against the copy, and prints a table:

    FAIL  the witness caught the mutation (good)
    PASS  the witness still passed: it cannot see the field (bad)

A control row runs every witness on the unmutated copy first; each must PASS there. Exit status
1 when a control fails or a mutation goes uncaught.

The copy is HEAD (`git archive`) with the harness files of the working tree laid over it
(--worktree: every tracked and untracked, not ignored, file of the working tree instead).

    .venv/bin/python tests/distributed/liveness_mutations.py [--worktree] [--keep] [FIELD ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARNESS = ["tests/distributed/scripts_liveness.py", "tests/unit/test_config_liveness.py",
           "tests/distributed/launch.py"]
LOOP, COMPONENTS, RL = "megarl/trainer/loop.py", "megarl/trainer/components.py", "megarl/trainer/rl.py"

# field -> (what the mutation does, [(file, text, replacement)]); every text must occur in its file
MUTATIONS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "algorithm.ppo_epochs": ("loop.py trains one epoch whatever ppo_epochs says", [
        (LOOP, "for _ in range(al.ppo_epochs):", "for _ in range(1):")]),
    "trainer.total_steps": ("loop.py runs one step whatever total_steps says", [
        (LOOP, "for step in range(state.step, tr.total_steps):", "for step in range(state.step, 1):"),
        (LOOP, "last = state.step == tr.total_steps", "last = state.step == 1")]),
    "trainer.seed": ("every read of trainer.seed in the RL path uses 0", [
        (LOOP, "init_distributed(cfg.parallel, seed=cfg.trainer.seed)", "init_distributed(cfg.parallel, seed=0)"),
        (LOOP, "tr.seed + step", "0 + step"),
        (COMPONENTS, "seed=cfg.trainer.seed + step", "seed=0 + step"),
        ("megarl/trainer/generation.py", "cfg.trainer.seed * 1_000_003", "0 * 1_000_003"),
        ("megarl/trainer/build.py", "seed=cfg.trainer.seed", "seed=0")]),
    "trainer.run_dir": ("the logger and checkpoints write to a fixed directory, not trainer.run_dir", [
        (COMPONENTS, "logger=MetricsLogger(cfg.trainer.run_dir,", "logger=MetricsLogger('mutant_run_dir',"),
        (COMPONENTS, "checkpoint.save_checkpoint(self.cfg.trainer.run_dir,",
         "checkpoint.save_checkpoint('mutant_run_dir',")]),
    "trainer.save_interval": ("loop.py saves at the last step only", [
        (LOOP, "if (tr.save_interval and state.step % tr.save_interval == 0) or last:", "if last:")]),
    "trainer.keep_last": ("checkpoints are never pruned (keep_last passed as None)", [
        (COMPONENTS, "self.cfg.trainer.keep_last,", "None,")]),
    "trainer.eval_interval": ("loop.py evaluates at the last step only", [
        (LOOP, "if (tr.eval_interval and state.step % tr.eval_interval == 0) or last:", "if last:")]),
    "trainer.log_interval": ("loop.py logs every step", [
        (LOOP, "if state.step % tr.log_interval == 0 or last:", "if True:")]),
    "trainer.tensorboard": ("the logger never writes TensorBoard files", [
        ("megarl/trainer/loggers.py", 'names = [n for n in t.loggers if t.tensorboard or n != "tensorboard"]',
         'names = [n for n in t.loggers if n != "tensorboard"]')]),
    "trainer.val_before_train": ("loop.py never evaluates before training", [
        (LOOP, "if (tr.val_before_train and state.step == 0)", "if (False and state.step == 0)")]),
    "algorithm.value_pretrain_ev_target": ("value pretraining never ends early (target read as None)", [
        (RL, "target = cfg.algorithm.value_pretrain_ev_target", "target = None")]),
}


def make_copy(dest: Path, worktree: bool) -> None:
    if worktree:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                               capture_output=True).stdout.decode().split("\0")
    else:
        archive = dest.parent / "head.tar"
        subprocess.run(["git", "archive", "-o", str(archive), "HEAD"], cwd=REPO, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        archive.unlink()
        files = HARNESS
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)


def run_witness(copy: Path, field: str, timeout: int) -> tuple[str, str]:
    """(PASS | FAIL (observations equal) | FAIL (error), the last lines of pytest's output)."""
    node = f"tests/unit/test_config_liveness.py::test_changing_the_field_changes_the_run[{field}]"
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-rfE", "-p", "no:cacheprovider", node], cwd=copy,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL (timeout)", ""
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "PASS", out
    if re.search(r"^FAILED ", out, re.M):
        return "FAIL (observations equal)", out
    return "FAIL (error)", out


def mutate(copy: Path, edits: list[tuple[str, str, str]]) -> dict[str, str]:
    """Applies the edits; returns the original text of every file touched."""
    originals: dict[str, str] = {}
    for path, text, replacement in edits:
        f = copy / path
        src = f.read_text()
        originals.setdefault(path, src)
        if text not in src:
            raise SystemExit(f"mutation text not found in {path}: {text!r} (the code changed: update MUTATIONS)")
        f.write_text(src.replace(text, replacement))
    return originals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fields", nargs="*", help="only these fields (default: all of MUTATIONS)")
    ap.add_argument("--worktree", action="store_true", help="copy the working tree, not HEAD + harness files")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per witness run")
    args = ap.parse_args()
    fields = args.fields or sorted(MUTATIONS)
    unknown = [f for f in fields if f not in MUTATIONS]
    if unknown:
        raise SystemExit(f"no mutation for {unknown}; known: {sorted(MUTATIONS)}")
    scratch = Path(tempfile.mkdtemp(prefix="liveness_mutations_"))
    copy = scratch / "repo"
    copy.mkdir()
    make_copy(copy, args.worktree)
    rows, bad = [], 0
    try:
        for field in fields:  # control: every witness passes on the unmutated copy
            t0 = time.time()
            result, out = run_witness(copy, field, args.timeout)
            rows.append((field, "none (control)", result, time.time() - t0))
            print(f"{field:40s} control: {result}", flush=True)
            if result != "PASS":
                bad += 1
                print(out[-3000:], flush=True)
        for field in fields:
            what, edits = MUTATIONS[field]
            originals = mutate(copy, edits)
            t0 = time.time()
            try:
                result, out = run_witness(copy, field, args.timeout)
            finally:
                for path, text in originals.items():
                    (copy / path).write_text(text)
            rows.append((field, what, result, time.time() - t0))
            print(f"{field:40s} mutated: {result}", flush=True)
            if result == "PASS" or "error" in result:
                bad += result == "PASS"
                print(out[-3000:], flush=True)
            else:  # the witness's message: the observation both runs gave
                print("    " + "\n    ".join(re.findall(r"^E\s+AssertionError: .*$", out, re.M)[:1]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n| field | mutation | witness |\n|---|---|---|")
    for field, what, result, secs in rows:
        print(f"| {field} | {what} | {result} ({secs:.0f} s) |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
