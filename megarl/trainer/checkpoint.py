"""Run checkpoints: step_N/{actor,critic}/ (torch_dist model + optimizer), trainer_state.pt, and
an atomically replaced `latest` file that marks the newest COMPLETE checkpoint.

A checkpoint directory without the `latest` mark (e.g. killed mid-write) is never loaded: only
the step named in `latest` is, and `latest` is replaced (os.replace) after every rank finished
writing. Retention removes the oldest complete step directories beyond `keep_last`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def read_latest(run_dir: str | Path) -> Path | None:
    """The complete checkpoint named by `latest`, or None when there is none."""
    mark = Path(run_dir) / "checkpoints" / LATEST
    if not mark.exists():
        return None
    name = mark.read_text().strip()
    if not re.fullmatch(r"step_\d+", name):
        raise ValueError(f"{mark}: corrupt latest mark {name!r} (expected step_<N>)")
    path = mark.parent / name
    if not path.is_dir():
        raise FileNotFoundError(f"{mark} names {path}, which does not exist")
    return path


def save_checkpoint(run_dir: str | Path, step: int, models: dict, trainer_state: dict, keep_last: int | None) -> Path:
    """Collective: every rank writes its shards; rank 0 writes the state and then the mark."""
    path = step_dir(run_dir, step)
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete earlier attempt at this step
    dist.barrier()
    for name, model in models.items():
        if dist.get_rank() == 0:
            (path / name).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        model.save(str(path / name))
    if dist.get_rank() == 0:
        torch.save(trainer_state, path / "trainer_state.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = path.parent / f".{LATEST}.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, path.parent / LATEST)
        _retain(path.parent, keep_last)
    dist.barrier()
    return path


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / "trainer_state.pt", weights_only=True)


def _retain(ckpt_root: Path, keep_last: int | None) -> None:
    if keep_last is None:
        return
    latest = (ckpt_root / LATEST).read_text().strip()
    steps = sorted((int(p.name.split("_")[1]), p) for p in ckpt_root.glob("step_*") if p.is_dir())
    complete = [p for s, p in steps if s <= int(latest.split("_")[1])]
    for p in complete[: max(0, len(complete) - keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
