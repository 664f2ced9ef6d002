"""Starting local ranks: a free TCP port for the rendezvous, and a module run under torchrun.

Used by the commands that start their own ranks when run plainly (the quickstart, checkpoint
conversion, some tools) and by the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, argv: list[str]) -> list[str]:
    """`python -m torch.distributed.run ... -m module argv` on nproc local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *argv]


def run_module(nproc: int, module: str, argv: list[str], env: dict | None = None) -> int:
    """Runs `module argv` on nproc local ranks with torchrun (one thread each unless OMP_NUM_THREADS
    says otherwise; the current directory importable, so `tools.*` modules resolve from the
    repository root); returns its exit status."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return subprocess.run(torchrun_command(nproc, module, argv), env=env).returncode
