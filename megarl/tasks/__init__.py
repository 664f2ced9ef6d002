"""Synthetic, verifiable tasks for the quickstart and tests.

`QUICKSTART_TASKS` maps `quickstart.task` to a `QuickstartTask`; a task named `x` lives in the
module `megarl.tasks.x`, which registers it on import (a lookup imports it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

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
    comparison: (label, dotted overrides) of a second RL run from the same SFT checkpoint (e.g.
        the same RL without tools, "no_tools", ("rollout.tools.enable=false",)), run after the
        first into <run_dir>/<label>; the table shows it as one more row. None for none.
    """

    write_files: Callable[[Path, Any], None]
    before_rl: Callable[[Any, Path, dict], None] | None = None
    table_metrics: tuple[str, ...] = ()
    comparison: tuple[str, tuple[str, ...]] | None = None


QUICKSTART_TASKS = Registry("quickstart task", lazy_package="megarl.tasks")


def quickstart_task(name: str) -> QuickstartTask:
    """The registered task `name` (importing `megarl.tasks.<name>` first if needed)."""
    return QUICKSTART_TASKS[name]


def write_disjoint_splits(out_dir: str | Path, sizes: dict[str, int], draw: Callable[[], tuple[Hashable, Any]],
                          make_row: Callable[[str, int, Any], dict]) -> dict[str, Path]:
    """Writes ``<split>.jsonl`` for each split of `sizes` (in its order) with pairwise-disjoint problems.

    draw() -> (key, problem) proposes a problem (a key seen before is drawn again); make_row(split,
    i, problem) is the i-th row of the split. Both may use the task's random generator: they are
    called in a fixed order, so a seed gives the same files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set = set()
    paths = {}
    for split, n in sizes.items():
        paths[split] = out / f"{split}.jsonl"
        with paths[split].open("w", encoding="utf-8") as f:
            i = 0
            while i < n:
                key, problem = draw()
                if key in seen:
                    continue
                seen.add(key)
                f.write(json.dumps(make_row(split, i, problem)) + "\n")
                i += 1
    return paths
