"""megarl's tools: the user tools at this level, benchmarks in `tools.bench`, research probes in
`tools.research`, and gpu_smoke's checks in `tools.smoke`. Each runs as a module from the repository
root (`python -m tools.bench.rollout`) or as a file from anywhere (`python tools/bench/rollout.py`):
a file run puts the repository root first on sys.path and runs the module (`run_as_module`)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent


def run_as_module(file: str) -> NoReturn:
    """Runs the tool `file`, started as a file (`python tools/bench/rollout.py`, whose few lines at
    the top made the repository root sys.path[0]), as its module (`python -m tools.bench.rollout`),
    then exits: the same code path, imports and argv either way. The root also goes first on
    PYTHONPATH, so that ranks or workers the tool starts as modules find `tools` and this checkout's
    `megarl` from any working directory."""
    name = ".".join(Path(file).resolve().relative_to(REPO).with_suffix("").parts)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    sys.exit(0)
