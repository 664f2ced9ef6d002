"""Metrics sink: rank 0 sends every step's metrics to the backends of `trainer.loggers`
(megarl.trainer.loggers: metrics.jsonl, TensorBoard, W&B, MLflow). Other ranks do nothing."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from megarl.parallel.distributed import phase
from megarl.trainer.loggers import LoggerSettings, open_backends


class MetricsLogger:
    """`MetricsLogger(run_dir, cfg=cfg)`: the loggers of cfg.trainer (job "sft": an SFT phase's
    own W&B / MLflow run); without cfg, metrics.jsonl plus TensorBoard when `tensorboard`."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, *, cfg=None, job: str = "rl"):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.backends: list = []
        if self.enabled:
            settings = (LoggerSettings.from_config(cfg, job) if cfg is not None
                        else LoggerSettings(names=(["tensorboard"] if tensorboard else []) + ["jsonl"]))
            self.backends = open_backends(Path(run_dir), settings)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        for b in self.backends:
            b.log(step, clean)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []


class PhaseTimer:
    """Accumulates wall time per phase: `with timer("rollout"): ...` -> metrics time/rollout
    (and names the phase meanwhile: megarl.parallel.distributed.phase)."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            with phase(name):
                yield
        finally:
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out
