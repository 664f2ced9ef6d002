"""Plan a megarl run (per-GPU memory and a step-time estimate): `python -m tools.plan --recipe R
--layout L --gpu h100`, the same as `megarl plan ...`. The model is megarl/planner/."""

import sys

from megarl.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
