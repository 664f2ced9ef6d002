"""Run checkpoints: step_N/{actor,critic}/ (torch_dist model + optimizer), trainer_state.pt,
rows/rank<R>.pt (the payloads of the rows each rank carries into the next step,
megarl.trainer.rows), and an atomically replaced `latest` file that marks the newest COMPLETE
checkpoint.

A checkpoint directory without the `latest` mark (e.g. killed mid-write) is never loaded: only
the step named in `latest` is, and `latest` is replaced (os.replace of an fsynced temporary
file) after every rank finished writing. Retention renames the oldest complete step directories
beyond `keep_last` to `.trash_step_N` (atomic) before deleting them, so every `step_N` at or
below the mark is complete even when a kill interrupts the deletion.

Async saves (trainer.async_save): megatron dist_checkpointing's async save writes each rank's
shards in a forked background process (GPU tensors are first copied to host memory, so training
goes on meanwhile). `finalize_async_saves` (every step, on every rank) finalises finished
writes: the torch_dist metadata files, then, on every rank, the same `latest` update as a
synchronous save. A writer that dies leaves no results, so the finalisation raises and `latest`
keeps naming the previous complete checkpoint. megatron's writers hand their results to the
finalisation through one process-wide first-in-first-out queue, so concurrent writers could
give a checkpoint's metadata another write's results (tools/bench/chaos.py caught exactly that: a
model's metadata pointing at the optimizer's shard offsets). Hence one checkpoint is in flight
at a time, and all its requests (model and optimizer of actor and critic) are written one after
another by a single background process.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.parallel.distributed import fault_point, phase

LATEST = "latest"
TRASH_PREFIX = ".trash_"
_ASYNC_QUEUE = None  # megatron AsyncCallsQueue, created by the first async save


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


def save_checkpoint(run_dir: str | Path, step: int, models: dict, trainer_state: dict, keep_last: int | None,
                    async_save: bool = False, rank_rows: dict | None = None) -> Path:
    """Collective: every rank writes its shards (and `rank_rows`, its carried row payloads, to
    rows/rank<R>.pt); rank 0 writes the state and then the mark (with `async_save`, the mark once
    `finalize_async_saves` has finalised every rank's writes)."""
    path = step_dir(run_dir, step)
    if async_save:
        finalize_async_saves(blocking=True)  # the previous checkpoint first (see the module doc)
    with phase("checkpoint_write"):
        if dist.get_rank() == 0 and path.exists():
            shutil.rmtree(path)  # an incomplete earlier attempt at this step
        dist.barrier()
        requests: list = []
        for name, model in models.items():
            if dist.get_rank() == 0:
                (path / name).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if async_save:
                requests += _async_model_save(model, path / name)
            else:
                model.save(str(path / name))
            fault_point("checkpoint_write")
        if rank_rows is not None:
            (path / "rows").mkdir(parents=True, exist_ok=True)
            torch.save(rank_rows, path / "rows" / f"rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            torch.save(trainer_state, path / "trainer_state.pt")
        dist.barrier()
        if not async_save:
            _mark_latest(path, keep_last)
            return path
        request = _one_request(requests)
        request.add_finalize_fn(lambda: _mark_latest(path, keep_last))
        _async_queue().schedule_async_request(request)
    return path


def _one_request(requests: list):
    """One AsyncRequest that writes `requests` one after another in one background process, then
    runs all their finalisation functions in order. Their device -> host copies happen here,
    at save time (where megatron's caller would make them)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    staged = []
    for r in requests:
        args = list(r.async_fn_args)
        if r.preload_fn is not None:
            args[1] = r.preload_fn()  # megatron's convention: argument 1 holds the write buckets
        staged.append((r.async_fn, args, r.async_fn_kwargs))

    def write_all():
        for fn, args, kwargs in staged:
            if fn is not None:
                fn(*args, **kwargs)

    return AsyncRequest(write_all, (), [fn for r in requests for fn in r.finalize_fns])


def finalize_async_saves(blocking: bool = False) -> None:
    """Collective (call on every rank alike): finalises the async saves whose writes finished on
    every rank (all of them, waiting, with `blocking`); a no-op without pending async saves."""
    if _ASYNC_QUEUE is not None and _ASYNC_QUEUE.get_num_unfinalized_calls():
        with phase("checkpoint_finalize"):
            _ASYNC_QUEUE.maybe_finalize_async_calls(blocking=blocking)


def _async_queue():
    global _ASYNC_QUEUE
    if _ASYNC_QUEUE is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _ASYNC_QUEUE = AsyncCallsQueue(persistent=False)
    return _ASYNC_QUEUE


def _async_model_save(model, path: Path) -> list:
    """The async requests of TrainModel.save's layout: <path>/model (+ hf/, metadata) and
    <path>/optimizer."""
    from megarl.weights import dist_ckpt, optim_ckpt

    requests: list = []
    dist_ckpt.save_megatron_checkpoint(model.chunks, path, model.hf_config, model.hf_source_dir,
                                       async_requests=requests)
    if model.optimizer is not None:
        if dist.get_rank() == 0:
            (path / "optimizer").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        requests.append(optim_ckpt.save(model.optimizer, dist_ckpt.model_sharded_state_dict(model.chunks),
                                        path / "optimizer", async_save=True))
    return requests


def _mark_latest(path: Path, keep_last: int | None) -> None:
    """Collective: after every rank's writes, rank 0 points `latest` at `path` and applies retention."""
    with phase("latest_update"):
        dist.barrier()
        if dist.get_rank() == 0:
            tmp = path.parent / f".{LATEST}.tmp"
            with open(tmp, "w") as f:
                f.write(path.name)
                f.flush()
                os.fsync(f.fileno())
            fault_point("latest_update")
            os.replace(tmp, path.parent / LATEST)
            _fsync_dir(path.parent)
            fault_point("latest_update")
            _retain(path.parent, keep_last)
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / "trainer_state.pt", weights_only=True)


def checkpoint_problems(path: Path) -> list[str]:
    """What makes the step directory `path` unloadable (empty when it is complete): a missing or
    unreadable trainer_state.pt or rows/rank<R>.pt, and per model directory a missing megarl_model.json or torch_dist
    file, foreign pickles, or a shard file shorter than its metadata says."""
    from megarl.weights.dist_ckpt import META_NAME, torch_dist_problems

    problems = []
    try:
        load_trainer_state(path)
    except Exception as e:  # noqa: BLE001 - any failure makes the checkpoint unloadable
        problems.append(f"{path / 'trainer_state.pt'}: {e}")
    for rows in sorted(path.glob("rows/rank*.pt")):
        try:
            torch.load(rows, weights_only=True)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{rows}: {e}")
    models = [p for p in sorted(path.iterdir()) if p.is_dir() and p.name != "rows"] if path.is_dir() else []
    if not models:
        problems.append(f"{path}: no model directory")
    for model in models:
        if not (model / META_NAME).exists():
            problems.append(f"{model / META_NAME} is missing")
        for sub in ("model", "optimizer"):
            if sub == "model" or (model / sub).exists():
                problems += torch_dist_problems(model / sub)
    return problems


def _retain(ckpt_root: Path, keep_last: int | None) -> None:
    for stale in ckpt_root.glob(f"{TRASH_PREFIX}step_*"):  # a deletion a kill interrupted
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last is None:
        return
    latest = (ckpt_root / LATEST).read_text().strip()
    steps = sorted((int(p.name.split("_")[1]), p) for p in ckpt_root.glob("step_*") if p.is_dir())
    complete = [p for s, p in steps if s <= int(latest.split("_")[1])]
    for p in complete[: max(0, len(complete) - keep_last)]:
        trash = p.with_name(TRASH_PREFIX + p.name)
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
