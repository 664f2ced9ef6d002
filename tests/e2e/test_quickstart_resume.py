"""`megarl quickstart ... trainer.resume=true` after a kill mid-RL (reduced sizes): the re-run skips
the model build, conversion and SFT, continues from the newest complete checkpoint and prints
the uninterrupted run's final line (wall_s and run_dir aside)."""

import json
import os
import re
import subprocess
import sys

from tests.e2e.test_quickstart import LAST, REPO

ARGS = ["sft.max_steps=2", "trainer.total_steps=2", "trainer.save_interval=1", "trainer.eval_interval=0",
        "algorithm.dynamic_sampling=false", "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4",
        "algorithm.mini_batch_size=16"]


def quickstart(run_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "megarl.cli", "quickstart", f"trainer.run_dir={run_dir}", *ARGS, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))


def test_resumed_quickstart_prints_the_uninterrupted_final_line(tmp_path):
    straight = quickstart(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # rank 0 kills the whole job (torchrun and both ranks) as step 2's actor update starts
    killed = quickstart(tmp_path / "resumed", "trainer.resume=true",
                        env={"MEGARL_CHAOS_KILL_AT": "actor_update:2@0:node"})
    assert killed.returncode != 0 and "MEGARL_CHAOS_KILL_AT: node rank 0 at actor_update 2" in killed.stderr
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_1"
    outputs = [tmp_path / "resumed" / f for f in ("tiny_model/model.safetensors", "task/train.jsonl",
                                                  "megatron_init/megarl_model.json", "sft_actor/sft_done.json")]
    written = [f.stat().st_mtime_ns for f in outputs]
    resumed = quickstart(tmp_path / "resumed", "trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "SFT ━" not in out and [f.stat().st_mtime_ns for f in outputs] == written  # build, conversion, SFT skipped
    assert re.search(r"resumed from \S+/checkpoints/step_1 at step 1", out)
    a, b = (LAST.match(p.stdout.strip().splitlines()[-1]) for p in (straight, resumed))
    assert a and b and (a[1], a[2]) == (b[1], b[2])
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_2"
    # the accuracies of a 2-step SFT are 0: the logged losses, KL, rewards and eval lengths say more
    rows = {name: [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/", "reward/time"))}
                   for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")}
    assert rows["resumed"][-2:] == rows["straight"][-2:] and "actor/pg_loss" in rows["straight"][-2]
