"""trainer.loggers (megarl.trainer.loggers): W&B offline and an MLflow file store hold the config,
tags and per-step metrics and continue the same run on resume (read back with their own readers);
W&B's files go to WANDB_DIR when it is set; start-up errors are clear; failures after start-up do
not end the run."""

import json
import socket
import sys

import pytest

from megarl.config import ConfigError, load_config
from megarl.trainer.loggers import Guarded, LoggerError
from megarl.trainer.metrics import MetricsLogger
from tests.unit.readback import mlflow_runs, wandb_runs


@pytest.fixture(autouse=True)
def no_wandb_dir(monkeypatch):
    """W&B's files under <run_dir>/wandb, as the tests read them, whatever the caller's WANDB_DIR."""
    monkeypatch.delenv("WANDB_DIR", raising=False)


def config(run_dir, *overrides):
    return load_config(None, [f"trainer.run_dir={run_dir}", "trainer.wandb_mode=offline", *overrides])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: connections are refused


def test_wandb_and_mlflow_hold_config_tags_metrics_and_resume_the_same_run(tmp_path):
    run = tmp_path / "run"
    over = ["trainer.loggers=[jsonl, wandb, mlflow]", "trainer.tags=[seed1, tiny]", "trainer.project=proj",
            "actor.lr=0.25"]
    logger = MetricsLogger(run, cfg=config(run, *over))
    logger.log(1, {"reward/mean": 0.5, "actor/entropy": float("nan")})
    logger.log(2, {"reward/mean": 0.75, "eval/arith/accuracy": 0.1})
    logger.close()
    ids = json.loads((run / "loggers.json").read_text())
    logger = MetricsLogger(run, cfg=config(run, *over, "trainer.resume=true"))
    logger.log(3, {"reward/mean": 1.0})
    logger.close()
    assert json.loads((run / "loggers.json").read_text()) == ids

    first, resumed = wandb_runs(run)
    assert first["summary"]["run_id"] == resumed["summary"]["run_id"] == ids["wandb"]
    assert first["summary"]["project"] == "proj" and first["summary"]["name"] == "run"
    assert first["summary"]["tags"] == ["seed1", "tiny"]
    assert first["summary"]["config"]["actor"]["lr"] == 0.25
    assert first["history"] == {1: {"reward/mean": 0.5}, 2: {"reward/mean": 0.75, "eval/arith/accuracy": 0.1}}
    assert resumed["history"] == {3: {"reward/mean": 1.0}}

    (ml,) = mlflow_runs((run / "mlruns").as_uri(), "proj")
    assert ml["id"] == ids["mlflow"]["run_id"] and ml["name"] == "run" and ml["status"] == "FINISHED"
    assert ml["history"]["reward/mean"] == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert "actor/entropy" not in ml["history"]  # non-finite values are left out (jsonl: null)
    assert ml["params"]["actor.lr"] == "0.25" and ml["params"]["trainer.tags"] == '["seed1", "tiny"]'
    assert ml["tags"]["seed1"] == ml["tags"]["tiny"] == "true"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["actor/entropy"] is None


@pytest.mark.parametrize("set_wandb_dir", [True, False])
def test_wandb_files_go_to_wandb_dir_when_it_is_set_else_to_the_run_dir(tmp_path, monkeypatch, set_wandb_dir):
    run, scratch = tmp_path / "run", tmp_path / "scratch"  # scratch does not exist yet: W&B makes it
    if set_wandb_dir:
        monkeypatch.setenv("WANDB_DIR", str(scratch))
    logger = MetricsLogger(run, cfg=config(run, "trainer.loggers=[jsonl, wandb]"))
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    home, elsewhere = (scratch, run) if set_wandb_dir else (run, scratch)
    (wb,) = wandb_runs(home)
    assert wb["summary"]["name"] == "run" and wb["history"] == {1: {"reward/mean": 0.5}}
    assert not (elsewhere / "wandb").exists()
    assert (run / "metrics.jsonl").is_file() and (run / "loggers.json").is_file()  # the rest stays in the run dir


def test_a_fresh_start_in_the_same_dir_is_a_new_run(tmp_path):
    run = tmp_path / "run"
    for _ in range(2):
        logger = MetricsLogger(run, cfg=config(run, "trainer.loggers=[mlflow]"))
        logger.log(1, {"x": 1.0})
        logger.close()
    assert len(mlflow_runs((run / "mlruns").as_uri(), "megarl")) == 2


def test_sft_logs_to_a_run_of_its_own(tmp_path):
    run = tmp_path / "run"
    logger = MetricsLogger(run / "sft", cfg=config(run, "trainer.loggers=[mlflow]",
                                                   f"trainer.mlflow_tracking_uri={tmp_path / 'store'}"), job="sft")
    logger.log(1, {"sft/nll": 2.0})
    logger.close()
    (ml,) = mlflow_runs((tmp_path / "store").as_uri(), "megarl")
    assert ml["name"] == "run-sft" and ml["tags"]["sft"] == "true"


def test_tensorboard_false_drops_the_tensorboard_logger(tmp_path):
    MetricsLogger(tmp_path / "a", cfg=config(tmp_path / "a", "trainer.tensorboard=false")).close()
    MetricsLogger(tmp_path / "b", cfg=config(tmp_path / "b")).close()
    assert not (tmp_path / "a" / "tb").exists() and (tmp_path / "b" / "tb").is_dir()


def test_a_logger_named_twice_is_refused():
    with pytest.raises(ConfigError, match="trainer.loggers"):
        load_config(None, ["trainer.loggers=[jsonl, jsonl]"])
    with pytest.raises(ConfigError, match="trainer.loggers"):
        load_config(None, ["trainer.loggers=[neptune]"])


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_missing_package_is_a_start_up_error(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(LoggerError, match=rf"needs the {package} package.*pip install"):
        MetricsLogger(tmp_path, cfg=config(tmp_path, f"trainer.loggers=[jsonl, {package}]"))


def test_unreachable_servers_are_start_up_errors(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(LoggerError, match="trainer.mlflow_tracking_uri: cannot reach"):
        MetricsLogger(tmp_path, cfg=config(tmp_path, "trainer.loggers=[mlflow]", f"trainer.mlflow_tracking_uri={url}"))
    monkeypatch.setenv("WANDB_BASE_URL", url)
    with pytest.raises(LoggerError, match="wandb .*cannot reach"):
        MetricsLogger(tmp_path, cfg=config(tmp_path, "trainer.loggers=[wandb]", "trainer.wandb_mode=online"))
    assert not (tmp_path / "wandb").exists()


def test_a_failing_client_after_start_up_is_a_warning(caplog):
    class Broken:
        name = "mlflow"

        def log(self, step, metrics):
            raise ConnectionError("server went away")

        def close(self):
            raise ConnectionError("server went away")

    g = Guarded(Broken())
    g.log(1, {"x": 1.0})
    g.log(2, {"x": 1.0})
    g.close()
    assert g.failures == 3 and "server went away" in caplog.text


def test_run_name_and_wandb_entity_reach_the_runs(tmp_path):
    run = tmp_path / "run"
    logger = MetricsLogger(run, cfg=config(run, "trainer.loggers=[wandb, mlflow]", "trainer.run_name=named",
                                           "trainer.wandb_entity=team-x"))
    logger.close()
    (wb,) = wandb_runs(run)
    assert wb["summary"]["name"] == "named" and wb["summary"]["entity"] == "team-x"
    assert [r["name"] for r in mlflow_runs((run / "mlruns").as_uri(), "megarl")] == ["named"]


def test_odd_config_keys_and_a_vanished_mlflow_run(tmp_path):
    import shutil

    run = tmp_path / "run"
    over = ["trainer.loggers=[mlflow]", "reward={sources: {'math*': math}, default_source: 'math*'}"]
    MetricsLogger(run, cfg=config(run, *over)).close()
    (first,) = mlflow_runs((run / "mlruns").as_uri(), "megarl")
    assert first["params"]["reward.sources.math_"] == "math"  # '*' is not allowed in MLflow names
    (gone,) = (run / "mlruns").glob(f"*/{first['id']}")
    shutil.rmtree(gone)  # the run is gone from the store: a resumed run starts a new MLflow run, not an error
    logger = MetricsLogger(run, cfg=config(run, *over, "trainer.resume=true"))
    logger.log(1, {"x": 1.0})
    logger.close()
    (again,) = mlflow_runs((run / "mlruns").as_uri(), "megarl")
    assert again["id"] != first["id"] and again["history"]["x"] == [(1, 1.0)]
