"""Logging set-up of megarl's processes: rank 0 logs at INFO, the other ranks only warnings."""

from __future__ import annotations

import logging
import os
import warnings


def setup_logging() -> None:
    """Root logging for this rank (RANK of torchrun, 0 outside it); megatron's own INFO dumps
    (per-bucket and optimizer-config lines) are kept out, and ranks other than 0 drop Python
    warnings, which every rank would otherwise repeat."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    if rank != 0:
        warnings.filterwarnings("ignore")
