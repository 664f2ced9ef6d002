"""Synthetic, verifiable tasks for the quickstart and tests.

`QUICKSTART_TASKS` maps `quickstart.task` to a `QuickstartTask`; a task named `x` lives in the
module `megarl.tasks.x`, which registers it on import (a lookup imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megarl.registry import Registry


@dataclass(frozen=True)
class QuickstartTask:
    """What `megarl quickstart` needs from a task.

    write_files(out_dir, cfg): writes sft.jsonl (rows: prompt, response), train.jsonl and
        eval.jsonl (prompt rows of the configured data.prompt_template) into out_dir; rank 0 only.
    before_rl(cfg, run_dir, sft_out): runs on every rank after the SFT warm start and before RL
        (e.g. trains a judge or a PRM and points cfg at it); None for nothing.
    table_metrics: eval metrics (keys of the evaluation dict) the quickstart table shows before
        and after RL, beside eval/accuracy.
    """

    write_files: Callable[[Path, Any], None]
    before_rl: Callable[[Any, Path, dict], None] | None = None
    table_metrics: tuple[str, ...] = ()


QUICKSTART_TASKS = Registry("quickstart task", lazy_package="megarl.tasks")


def quickstart_task(name: str) -> QuickstartTask:
    """The registered task `name` (importing `megarl.tasks.<name>` first if needed)."""
    return QUICKSTART_TASKS[name]
