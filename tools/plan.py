"""Plan a megarl run (per-GPU memory and a step-time estimate): `python -m tools.plan --recipe R
--layout L --gpu h100`, the same as `megarl plan ...`. The model is megarl/planner/."""

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.plan`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import sys

from megarl.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
