"""A rich progress bar per phase (rank 0 only; silent elsewhere and when disabled)."""

from __future__ import annotations

import rich.progress  # noqa: F401 - at import, before any seeding: rich draws from Python's global RNG when imported


class Progress:
    def __init__(self, name: str, total: int, start: int = 0, enabled: bool = True):
        self._bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
        from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
        )
        self._bar.start()
        self._task = self._bar.add_task(name, total=total, completed=start, info="")

    def update(self, completed: int, **info) -> None:
        if self._bar is None:
            return
        text = " ".join(f"{k}={v:.3f}" for k, v in info.items() if isinstance(v, (int, float)))
        self._bar.update(self._task, completed=completed, info=text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
