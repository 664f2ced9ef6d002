"""Metrics sink: one JSON object per step in run_dir/metrics.jsonl plus TensorBoard scalars.
Only rank 0 writes."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from megarl.parallel.distributed import phase


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else None) for k, v in clean.items()}}) + "\n")
        if self.writer is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
