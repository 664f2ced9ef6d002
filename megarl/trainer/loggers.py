"""The metrics backends behind `trainer.loggers`, opened on rank 0 only (megarl.trainer.metrics).

- ``jsonl``: one JSON object per `log` call in ``<dir>/metrics.jsonl``, non-finite values as null;
  the quickstart, ``megarl report`` and resumed quickstarts read it.
- ``tensorboard``: scalars under ``<dir>/tb``.
- ``wandb``: a W&B run holding the resolved config (``wandb.config``), the tags and every metric
  at its step; W&B's own files go to ``$WANDB_DIR/wandb`` when WANDB_DIR is set (W&B's own variable,
  e.g. a scratch disk), else to ``<dir>/wandb`` (offline mode writes nothing else).
- ``mlflow``: an MLflow run in the experiment ``trainer.project`` holding the resolved config as
  params (dotted keys) and as the artifact ``config.yaml``, the tags (one key per tag, value
  "true") and every metric at its step. With no tracking URI configured the store is
  ``<trainer.run_dir>/mlruns`` (MLflow's file store, which MLflow 3 accepts only with
  MLFLOW_ALLOW_FILE_STORE=true: set here for that store only).

``<dir>`` is the run dir (``<run_dir>/sft`` for SFT). The W&B run id and the MLflow run id are
kept in ``<dir>/loggers.json``; a run started with ``trainer.resume=true`` continues those runs,
so a resumed job appends to the same W&B / MLflow run.

Start-up errors are raised as `LoggerError` before the first step, naming the config field: a
logger whose package is not installed, a W&B or MLflow server that cannot be reached (a TCP
connect with a short timeout), or a W&B / MLflow client that refuses to start the run. The first
two need no run: `check_loggers(cfg)` finds them, with the same messages, where the config is loaded
(the commands that start ranks call it before torchrun, `megarl train` / `sft` on rank 0 before any
work). After start-up a W&B or MLflow call that fails is logged as a warning and the run goes on;
the jsonl and TensorBoard files stay complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

IDS_FILE = "loggers.json"  # W&B / MLflow run ids of the run dir, for trainer.resume
CONNECT_TIMEOUT_S = 10.0
PACKAGES = {"wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.17.2"}  # pyproject's [loggers] extra


class LoggerError(RuntimeError):
    """A logger of trainer.loggers cannot start; raised before any training step."""


@dataclass
class LoggerSettings:
    """What the backends need from the config (`from_config`), without the config itself."""

    names: list[str]
    project: str = "megarl"
    run_name: str = "run"
    tags: list[str] = field(default_factory=list)
    wandb_mode: str | None = None
    wandb_entity: str | None = None
    mlflow_tracking_uri: str | None = None
    resume: bool = False
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg, job: str = "rl") -> "LoggerSettings":
        """trainer.* of `cfg`; `job` "sft" names the run "<name>-sft", tags it "sft" and never
        resumes (an SFT phase starts over). Every job of a run shares its MLflow store (default
        <trainer.run_dir>/mlruns)."""
        from megarl.config import config_to_dict

        t = cfg.trainer
        names = [n for n in t.loggers if t.tensorboard or n != "tensorboard"]
        name = t.run_name or Path(t.run_dir).resolve().name
        rl = job == "rl"
        store = t.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or str(Path(t.run_dir) / "mlruns")
        return cls(names=names, project=t.project, run_name=name if rl else f"{name}-{job}",
                   tags=list(t.tags) + ([] if rl else [job]), wandb_mode=t.wandb_mode, wandb_entity=t.wandb_entity,
                   mlflow_tracking_uri=store, resume=t.resume and rl, config=config_to_dict(cfg))


def finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


class JsonlBackend:
    name = "jsonl"

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in finite(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def require(package: str):
    """The imported package, or LoggerError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise LoggerError(f"trainer.loggers: {package!r} needs the {package} package, which is not installed here "
                          f"({e}); pip install '{PACKAGES[package]}' (or megarl[loggers]), or drop {package} "
                          "from trainer.loggers") from e


def check_reachable(url: str, what: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """LoggerError unless a TCP connection to `url`'s host and port opens within `timeout_s`."""
    u = urlparse(url)
    if not u.hostname:
        raise LoggerError(f"{what}: {url!r} is not a URL with a host")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise LoggerError(f"{what}: cannot reach {url} ({type(e).__name__}: {e}); check the address and the "
                          "network, or log offline") from e


def wandb_ready(s: LoggerSettings):
    """(the wandb module, the W&B mode) once the package imports and, online, the server accepts a
    connection; LoggerError otherwise."""
    wandb = require("wandb")
    mode = s.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    if mode == "online":
        check_reachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"),
                        "trainer.loggers: wandb (online; trainer.wandb_mode=offline logs without a network)")
    return wandb, mode


def wandb_dir(out: Path) -> str:
    """Where W&B writes its files (its ``wandb/`` folder): WANDB_DIR when set, else `out`. wandb.init's
    `dir` argument wins over the variable, so the variable is read here."""
    return os.environ.get("WANDB_DIR") or str(out)


class WandbBackend:
    name = "wandb"

    def __init__(self, out: Path, s: LoggerSettings, run_id: str | None):
        wandb, mode = wandb_ready(s)
        try:
            self.run = wandb.init(project=s.project, entity=s.wandb_entity, name=s.run_name, tags=s.tags,
                                  config=s.config, dir=wandb_dir(out), mode=mode, id=run_id,
                                  resume="allow" if run_id else None, reinit="create_new",
                                  settings=wandb.Settings(init_timeout=60.0))
        except Exception as e:  # W&B raises its own error types (no API key, refused login, timeout)
            raise LoggerError(f"trainer.loggers: wandb could not start the run ({type(e).__name__}: {e})") from e
        self.id = self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_uri(s: LoggerSettings, out: Path) -> str:
    """The tracking URI: trainer.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else <out>/mlruns;
    a local path becomes a file: URI."""
    uri = s.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or str(out / "mlruns")
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        path = Path(urlparse(uri).path if scheme else uri).resolve()
        return path.as_uri()
    return uri


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values of a nested config dict (lists as JSON)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


def mlflow_ready(uri: str) -> None:
    """LoggerError unless the MLflow client imports and a server URI (http(s)) accepts a connection."""
    require("mlflow")
    if urlparse(uri).scheme in ("http", "https"):
        check_reachable(uri, "trainer.mlflow_tracking_uri")


class MlflowBackend:
    name = "mlflow"

    def __init__(self, out: Path, s: LoggerSettings, run_id: str | None):
        self.uri = mlflow_uri(s, out)
        mlflow_ready(self.uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        if urlparse(self.uri).scheme == "file":
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(s.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(s.project)
            if run_id is not None and not self._exists(run_id):
                log.warning("mlflow: the run %s of %s is not in %s; starting a new run", run_id, IDS_FILE, self.uri)
                run_id = None
            if run_id is not None:
                self.client.update_run(run_id, status="RUNNING")
            else:
                tags = {mlflow_key(t): "true" for t in s.tags}
                run_id = self.client.create_run(exp_id, run_name=s.run_name, tags=tags).info.run_id
                params = [Param(mlflow_key(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_params(s.config).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                    self.client.log_batch(run_id, params=params[i:i + 100])
            self.client.log_dict(run_id, s.config, "config.yaml")
        except Exception as e:  # MLflow raises MlflowException and REST errors
            raise LoggerError(f"trainer.loggers: mlflow could not start the run at {self.uri} "
                              f"({type(e).__name__}: {e})") from e
        self.id = run_id

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), v, now, step) for k, v in finite(metrics).items()]
        for i in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.id, metrics=items[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def mlflow_key(key: str) -> str:
    """MLflow metric, param and tag names allow letters, digits, _ - . / : and spaces; anything else
    (a reward route pattern's *, ...) becomes _."""
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in key)


class Guarded:
    """A W&B / MLflow backend whose failures after start-up are warnings, not crashes."""

    def __init__(self, backend):
        self.backend, self.name, self.failures = backend, backend.name, 0

    def _call(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # any client error: the run must go on
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("logger %s: %s failed (%d so far; the run goes on): %s: %s", self.name, what,
                            self.failures, type(e).__name__, e)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._call(f"logging step {step}", self.backend.log, step, metrics)

    def close(self) -> None:
        self._call("closing", self.backend.close)


def check_loggers(cfg) -> None:
    """The start-up checks that need no run, made where the config is loaded (before torchrun starts
    ranks, before a model is built): the W&B / MLflow package of each logger of `trainer.loggers`
    imports, and an online W&B or an MLflow server accepts a TCP connection. LoggerError with the
    messages `open_backends` would raise otherwise."""
    s = LoggerSettings.from_config(cfg)
    for name in s.names:
        if name == "wandb":
            wandb_ready(s)
        elif name == "mlflow":
            mlflow_ready(mlflow_uri(s, Path(cfg.trainer.run_dir)))


def open_backends(out: Path, s: LoggerSettings) -> list:
    """The backends of `s.names`, in that order; the W&B / MLflow run ids are stored in
    <out>/loggers.json (and read back from there when `s.resume`). If one cannot start, those
    already open are closed and LoggerError is raised."""
    out.mkdir(parents=True, exist_ok=True)
    ids_path = out / IDS_FILE
    stored = json.loads(ids_path.read_text()) if s.resume and ids_path.exists() else {}
    backends: list = []
    try:
        for name in s.names:
            if name == "jsonl":
                backends.append(JsonlBackend(out))
            elif name == "tensorboard":
                backends.append(TensorBoardBackend(out))
            elif name == "wandb":
                backends.append(Guarded(WandbBackend(out, s, stored.get("wandb"))))
            elif name == "mlflow":
                prior = stored.get("mlflow") or {}
                same_store = prior.get("tracking_uri") == mlflow_uri(s, out)
                backends.append(Guarded(MlflowBackend(out, s, prior.get("run_id") if same_store else None)))
            else:
                raise LoggerError(f"trainer.loggers: unknown logger {name!r} (tensorboard, jsonl, wandb, mlflow)")
    except BaseException:
        for b in backends:
            b.close()
        raise
    ids = {}
    for b in backends:
        if b.name == "wandb":
            ids["wandb"] = b.backend.id
        elif b.name == "mlflow":
            ids["mlflow"] = {"run_id": b.backend.id, "tracking_uri": b.backend.uri}
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1))
    return backends
