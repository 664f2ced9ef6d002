"""A logger of trainer.loggers that cannot start (package not installed, server unreachable) is
found where the config loads, with the message start-up would give: `megarl quickstart`,
`launch/local.py` and `tools/train_genrm.py` before torchrun starts a rank, `megarl train` before any
work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.trainer.loggers import LoggerError, check_loggers
from megarl.trainer.metrics import MetricsLogger
from tests.unit.test_loggers import closed_port

REPO = Path(__file__).resolve().parents[2]
MISSING_WANDB = ("config error: trainer.loggers: 'wandb' needs the wandb package, which is not installed here "
                 "(No module named 'wandb'); pip install 'wandb==0.31.0' (or megarl[loggers]), or drop wandb from "
                 "trainer.loggers")


@pytest.fixture
def env_without_wandb(tmp_path):
    """The environment of a process in which `import wandb` fails as if the package were not installed."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), str(REPO)]), PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS="1")


CASES = {  # what breaks -> (the modules made unimportable, environment, overrides)
    "wandb not installed": (["wandb"], {}, ["trainer.loggers=[jsonl, wandb]", "trainer.wandb_mode=offline"]),
    "mlflow not installed": (["mlflow"], {}, ["trainer.loggers=[mlflow]"]),
    "W&B server unreachable": ([], {"WANDB_BASE_URL": "http://127.0.0.1:{port}"},
                               ["trainer.loggers=[wandb]", "trainer.wandb_mode=online"]),
    "MLflow server unreachable": ([], {}, ["trainer.loggers=[jsonl, mlflow]",
                                           "trainer.mlflow_tracking_uri=http://127.0.0.1:{port}"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_loggers_finds_what_start_up_finds_with_the_same_message(tmp_path, monkeypatch, case):
    hidden, env, overrides = CASES[case]
    port = closed_port()
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(port=port))
    cfg = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", *(o.format(port=port) for o in overrides)])
    with pytest.raises(LoggerError) as at_start_up:
        MetricsLogger(tmp_path / "run", cfg=cfg)
    with pytest.raises(LoggerError) as at_load:
        check_loggers(cfg)
    assert str(at_load.value) == str(at_start_up.value)
    assert str(at_load.value).startswith(("trainer.loggers: ", "trainer.mlflow_tracking_uri: "))


def test_loggers_that_can_start_pass_and_nothing_is_written(tmp_path):
    run = tmp_path / "run"
    check_loggers(load_config(None, [f"trainer.run_dir={run}", "trainer.loggers=[tensorboard, jsonl, wandb, mlflow]",
                                     "trainer.wandb_mode=offline"]))  # W&B offline, MLflow's file store
    assert not run.exists()


def megarl(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_quickstart_stops_before_torchrun_on_a_missing_logger_package(tmp_path, env_without_wandb):
    run = tmp_path / "qs"
    proc = megarl(["quickstart", f"trainer.run_dir={run}", "trainer.loggers=[jsonl, wandb]",
                   "trainer.wandb_mode=offline"], tmp_path, env_without_wandb)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, MISSING_WANDB, "")
    assert not run.exists()  # no rank started: no tiny model, no conversion, no SFT


def test_megarl_train_stops_at_load_on_a_missing_logger_package(tmp_path, env_without_wandb):
    run = tmp_path / "train"
    proc = megarl(["train", f"trainer.run_dir={run}", "trainer.loggers=[wandb]", "trainer.wandb_mode=offline"],
                  tmp_path, env_without_wandb)
    assert (proc.returncode, proc.stderr.strip()) == (2, MISSING_WANDB)
    assert not run.exists()  # not even the config was written


def test_local_launcher_stops_before_torchrun_on_a_missing_logger_package(monkeypatch, capsys):
    from tests.unit.test_launch import _load

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.chdir(REPO)
    local = _load("local")
    rc = local.main(["--recipe", "configs/recipes/qwen2.5-7b/dapo.yaml", "--layout", "configs/layouts/qwen2.5-7b/1node.yaml",
                     "--dryrun", "trainer.loggers=[jsonl, wandb]", "trainer.wandb_mode=offline"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""  # not even the dry run's command
    assert out.err.startswith("error: config: trainer.loggers: 'wandb' needs the wandb package") and "pip install" in out.err


def test_train_genrm_stops_before_its_ranks_on_a_missing_logger_package(tmp_path, monkeypatch):
    from tools.train_genrm import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit, match=r"^tools/train_genrm.py: trainer.loggers: 'wandb' needs the wandb package"):
        main(["--train-pairs", str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "judge"), "--nproc", "2",
              "trainer.loggers=[wandb]", "trainer.wandb_mode=offline"])
    assert not (tmp_path / "judge").exists()
