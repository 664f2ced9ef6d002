"""A pool of persistent math-verify worker processes with a hard deadline per check.

math-verify's timeouts use SIGALRM, which works only in the main thread, and an alarm cannot
interrupt a computation inside C code. Checks therefore run in worker processes
(`_math_worker.py`): a check that misses its deadline gets its worker killed (SIGKILL) and
replaced on next use, so a pathological expression costs at most `timeout_s` plus one worker
restart, from any thread. Thread-safe: a worker serves one check at a time; callers block
while all workers are busy.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megarl.rewards.types import RewardError, RewardTimeout

_WORKER = Path(__file__).with_name("_math_worker.py")
READY_TIMEOUT_S = 120.0  # importing sympy on a loaded machine


class _Worker:
    def __init__(self, memory_mb: int):
        # -P (not -I): the worker must import what this process imports, including packages
        # that reach it through PYTHONPATH (pip --target installs, containers), while the
        # current directory stays off its sys.path.
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-B", str(_WORKER), str(memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            close_fds=True, start_new_session=True,
        )
        self._buf = b""
        self.ready = False

    def start_ready(self) -> None:
        """Waits for the worker's ready line; on failure kills it and raises RewardError with the
        end of its stderr (an ImportError, say)."""
        try:
            reply = self.read_line(time.monotonic() + READY_TIMEOUT_S)
        except TimeoutError:
            reply = None
        try:
            ready = reply is not None and bool(json.loads(reply).get("ready"))
        except (ValueError, AttributeError):  # something else on its stdout first
            ready = False
        if not ready:
            raise RewardError("math-verify worker failed to start (is math-verify importable by "
                              f"{sys.executable}?): {self.kill() or 'no error output'}")
        self.ready = True

    def read_line(self, deadline: float) -> bytes | None:
        """One reply line, or None on EOF; raises TimeoutError at the deadline."""
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise TimeoutError
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def kill(self) -> str:
        """Kills the worker, closes its pipes; returns the last 3 lines of its stderr."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self._stderr.closed:  # killed before
            return ""
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        for pipe in (self.proc.stdin, self.proc.stdout, self._stderr):
            pipe.close()
        return " | ".join(tail)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
            self.proc.stdout.close()
            self._stderr.close()
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class VerifyPool:
    """`size` math-verify workers, started lazily; each limited to `memory_mb` of address space."""

    def __init__(self, size: int = 2, memory_mb: int = 4096):
        if size < 1:
            raise ValueError(f"VerifyPool: size must be >= 1, got {size}")
        self.size, self.memory_mb = size, memory_mb
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)
        self.restarts = 0
        self._closed = False

    def warmup(self) -> None:
        """Starts every worker now (in parallel) instead of on first use."""
        taken = [self._idle.get() for _ in range(self.size)]
        fresh = [_Worker(self.memory_mb) if w is None else w for w in taken]
        try:
            for w, old in zip(fresh, taken):
                if old is None:
                    w.start_ready()
        finally:  # a worker whose ready line was not read (an earlier one failed) is not reused
            for w, old in zip(fresh, taken):
                if old is None and not w.ready:
                    w.kill()  # also one that exited: its pipes are closed
                self._idle.put(w if w.ready and w.proc.poll() is None else None)

    def verify(self, gold: str, pred: str, timeout_s: float) -> bool:
        """math-verify equivalence of two answer strings (gold first). Raises RewardTimeout
        past `timeout_s` (not counting a worker start) and RewardError if the worker fails."""
        if self._closed:
            raise RewardError("VerifyPool is closed")
        worker = self._idle.get()
        try:
            if worker is None:  # a worker that fails to start is not put back: the next call retries
                fresh = _Worker(self.memory_mb)
                fresh.start_ready()
                worker = fresh
            soft = max(1, int(timeout_s) - 1)  # math-verify's alarm, a second before the kill
            request = json.dumps({"gold": gold, "pred": pred, "timeout": soft}) + "\n"
            deadline = time.monotonic() + timeout_s
            try:
                worker.proc.stdin.write(request.encode())
                worker.proc.stdin.flush()
                line = worker.read_line(deadline)
            except TimeoutError:
                worker.kill()
                worker, self.restarts = None, self.restarts + 1
                raise RewardTimeout(f"math-verify check exceeded {timeout_s:.1f}s") from None
            except OSError:  # broken pipe: the worker is gone
                line = None
            if line is None:
                worker.kill()
                worker = None
                raise RewardError("math-verify worker died (memory limit or crash)")
            reply = json.loads(line)
        finally:
            self._idle.put(worker)
        if reply.get("timeout"):
            raise RewardTimeout(f"math-verify timed out internally ({soft}s per call)")
        if "error" in reply:
            raise RewardError(f"math-verify: {reply['error']}")
        return bool(reply["correct"])

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                return
            if w is not None:
                w.close()


_default_pool: VerifyPool | None = None
_default_lock = threading.Lock()


def default_pool() -> VerifyPool:
    """The process-wide pool; size from MEGARL_MATH_WORKERS (default min(4, cpu count))."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            size = int(os.environ.get("MEGARL_MATH_WORKERS", min(4, os.cpu_count() or 1)))
            _default_pool = VerifyPool(size=size)
            atexit.register(_default_pool.close)
        return _default_pool
