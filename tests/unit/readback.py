"""Reading a run's W&B and MLflow records back with the libraries' own readers (shared by
tests/unit/test_loggers.py and tests/e2e/test_ecosystem_quickstart.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def wandb_runs(run_dir: Path) -> list[dict]:
    """Every offline W&B run under run_dir/wandb, oldest first, as `wandb leet inspect` reads it:
    {"summary": the --summary object (run id, project, name, tags, config), "history": {step:
    metrics}}."""
    out = []
    for d in sorted((Path(run_dir) / "wandb").glob("offline-run-*")):
        summary = json.loads(_inspect(d, "--summary", "--json"))
        history = {}
        for line in _inspect(d, "--json").splitlines():
            rec = json.loads(line)
            if rec.get("type") == "history":
                item = rec["history"]["item"]
                history[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
        out.append({"summary": summary, "history": history, "dir": d.name})
    return out


def _inspect(run: Path, *flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run), *flags], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def mlflow_runs(tracking_uri: str, experiment: str) -> list[dict]:
    """Every run of `experiment` in the store: {"id", "name", "status", "params", "tags",
    "history": {metric: [(step, value), ...]}}, read with MlflowClient."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {tracking_uri}"
    runs = []
    for r in client.search_runs([exp.experiment_id]):
        history = {k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
                   for k in r.data.metrics}
        runs.append({"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
                     "params": dict(r.data.params), "tags": dict(r.data.tags), "history": history})
    return runs
