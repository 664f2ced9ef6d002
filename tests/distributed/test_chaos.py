"""The 5-trial CI version of `python -m tools.bench.chaos --trials 50`: the CPU quickstart job (2 RL
steps, a checkpoint after each) is SIGKILLed once per trial - the whole job or one rank - in
each of rollout, reward, update, checkpoint write and `latest` update (one trial saving with
trainer.async_save), resumed with trainer.resume=true, and must end exactly like the
uninterrupted run (metrics, every step's trainer state, the final line) with only complete
checkpoints at or below `latest`."""

import json
import os
import subprocess
import sys

from tests.distributed.launch import REPO


def test_five_chaos_trials_lose_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench.chaos", "--trials", "5", "--steps", "2",
                           "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["trials"] == 5 and s["failures"] == 0 and s["missing_phases"] == []
    assert s["kills_by_phase"] == {"rollout": 1, "reward": 1, "update": 1, "checkpoint_write": 1, "latest_update": 1}
    assert s["kills_by_kind"] == {"phase": 3, "rank": 2} and s["async_save_trials"] == 1
    assert s["unloadable_checkpoints"] == 0 and s["metric_mismatches"] == 0 and s["data_mismatches"] == 0
    assert [t["problems"] for t in report["trials"]] == [{}] * 5
    assert "chaos: trials=5 " in proc.stdout
