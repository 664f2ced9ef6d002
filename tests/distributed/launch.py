"""Runs a script under torchrun with N gloo ranks and returns its JSON result (written by rank 0)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, args: list[str], out_json: Path, timeout: int = 600,
                 strict_device: bool = True) -> dict:
    """strict_device: run under the CPU runtime's strict device mode (megarl.parallel.strict_device),
    so a tensor a GPU run would find on the wrong device fails here too."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
               MEGARL_STRICT_DEVICE="1" if strict_device else "0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(script), "--out", str(out_json), *args,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: killing torchrun alone would leave
        # the workers running (and holding the CPU) for the rest of the test session
        for p in [*psutil.Process(proc.pid).children(recursive=True), proc]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {script} timed out after {timeout} s; killed it and its workers:\n"
                             f"{(stdout + stderr)[-3000:]}") from None
    if proc.returncode != 0:
        text = stdout + stderr
        first = text.find("Traceback")
        head = text[first : first + 5000] if first >= 0 else ""
        raise AssertionError(f"torchrun {script} failed (rc={proc.returncode}):\n{head}\n...\n{text[-2000:]}")
    return json.loads(Path(out_json).read_text())
