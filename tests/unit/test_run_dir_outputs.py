"""What a run writes lives under trainer.run_dir unless the user points elsewhere: every preset and
recipe, loaded with another run dir, derives the PRM checkpoint and the MLflow store from it, and no
config file names an output path of its own under runs/ other than trainer.run_dir."""

import glob
import os
from pathlib import Path

import pytest
import yaml

from megarl.config import load_config
from megarl.trainer.build import prm_dir
from megarl.trainer.loggers import LoggerSettings

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(glob.glob(str(REPO / "configs" / "quickstart" / "*.yaml"))
                 + glob.glob(str(REPO / "configs" / "algorithms" / "*.yaml"))
                 + glob.glob(str(REPO / "configs" / "recipes" / "*" / "*.yaml")))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: os.path.relpath(p, REPO))
def test_outputs_follow_the_run_dir(preset, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "elsewhere"
    cfg = load_config(preset, [f"trainer.run_dir={run}"])
    assert prm_dir(cfg) == run / "prm"
    assert LoggerSettings.from_config(cfg).mlflow_tracking_uri == str(run / "mlruns")
    assert LoggerSettings.from_config(cfg, job="sft").mlflow_tracking_uri == str(run / "mlruns")


def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for v in tree:
            yield from leaves(v, prefix)
    else:
        yield prefix.rstrip("."), tree


def test_no_config_file_writes_under_runs_outside_its_run_dir():
    offenders = []
    for path in glob.glob(str(REPO / "configs" / "**" / "*.yaml"), recursive=True):
        for key, value in leaves(yaml.safe_load(Path(path).read_text()) or {}):
            if isinstance(value, str) and value.startswith("runs/") and key != "trainer.run_dir":
                offenders.append(f"{os.path.relpath(path, REPO)}: {key}={value}")
    assert not offenders, offenders
