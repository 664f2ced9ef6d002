"""The README's main job, shortened: `megarl quickstart` end to end on 2 gloo ranks (TP=2)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAST = re.compile(r"^quickstart: accuracy_before=(\S+) accuracy_after=(\S+) wall_s=(\S+) run_dir=(\S+)$")


def test_quickstart_runs_end_to_end(tmp_path):
    run = tmp_path / "qs"
    cmd = [sys.executable, "-m", "megarl.cli", "quickstart", f"trainer.run_dir={run}", "sft.max_steps=4",
           "trainer.total_steps=2", "trainer.eval_interval=1", "algorithm.dynamic_sampling=false",
           "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", "algorithm.mini_batch_size=16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = LAST.match(last)
    assert m, last
    before, after, wall = float(m[1]), float(m[2]), float(m[3])
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0 and wall > 0 and Path(m[4]) == run
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in evals] == [0, 1, 2] and evals[-1]["eval/accuracy"] == after
    for key in ("reward/accuracy", "response_length/mean", "actor/clipfrac", "actor/approx_kl", "actor/entropy",
                "actor/grad_norm", "actor/lr", "time/rollout", "time/weight_sync", "perf/tokens_per_s"):
        assert key in steps[-1], key
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "sft_actor" / "megarl_model.json").exists()
