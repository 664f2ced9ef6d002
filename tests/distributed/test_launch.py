"""tests/distributed/launch.py: a torchrun that runs past its timeout fails the test and leaves no
worker behind (torchrun gives each worker a session of its own, so killing torchrun alone would not)."""

import time

import psutil
import pytest

from tests.distributed.launch import run_worker


def test_a_timed_out_torchrun_takes_its_workers_with_it(tmp_path):
    with pytest.raises(AssertionError, match="timed out after 20 s"):
        run_worker("scripts_hang.py", 2, tmp_path, timeout=20)
    pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(2)]
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
