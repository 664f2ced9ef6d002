"""The caller's half of the warm sandbox: one zygote process per caller process
(`_sandbox_zygote.py`, its docstring has the isolation) that forks a fresh namespaced, limited
child per run, so a short program costs a few forks instead of two Python start-ups and a dozen
mounts (~55 ms -> a few ms of CPU).

`Zygote.run(request, deadline, max_bytes)` hands the zygote a memfd with the request (code,
stdin, files, per-run uid slot, rlimits, tmpfs size) and three pipes it created itself: the
program's stdout, stderr and a status pipe on which the run's pid 1 writes the program's wait
status and CPU seconds. It reads them until the status arrives and the output ends (or 0.5 s
after the status: a process left in the namespace is killed with it), until `deadline`
(monotonic seconds; then "kill <id>" ends the run's whole pid namespace), or until stdout or
stderr passes `max_bytes` (killed the same way). Thread-safe; a process that forked gets a zygote
of its own on first use. Raises `ZygoteError` when the zygote cannot start or died (the caller
falls back to the fresh launcher).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ZYGOTE = Path(__file__).with_name("_sandbox_zygote.py")
STATUS = struct.Struct("id")  # as _sandbox_zygote.STATUS: wait status, CPU seconds
_LAUNCHER_FAILED = 125


class ZygoteError(RuntimeError):
    """The warm sandbox's zygote could not start, or died."""


@dataclass
class RawRun:
    stdout: str
    stderr: str
    status: int | None  # the program's wait status; None when it never reported one
    cpu_s: float
    timed_out: bool
    overflow: bool


class Zygote:
    """A zygote started by `python -I -B -X utf8 _sandbox_zygote.py spec` (`spec_for(base_dir)`
    gives the spec: the fresh path's root skeleton, id map and environment fields)."""

    def __init__(self, python: str, spec_for: Callable[[Path], dict]) -> None:
        self._python, self._spec_for = python, spec_for
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._base: Path | None = None
        self._owner = -1
        self._next = 0
        atexit.register(self.close)

    # ---- lifecycle ----------------------------------------------------------------------
    def _ensure(self) -> None:
        if self._owner != os.getpid():  # a forked child: the parent's zygote is not ours to use
            self._proc = self._sock = self._base = None
            self._owner = os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return
        self._cleanup()
        base = Path(tempfile.mkdtemp(prefix="megarl-zygote-"))  # not megarl-sbx-*: cleanup_stale must not reap it
        (base / "root").mkdir()
        (base / "work").mkdir()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = {**self._spec_for(base), "control_fd": theirs.fileno()}
        with open(base / "zygote.log", "wb") as log:
            self._proc = subprocess.Popen(
                [self._python, "-I", "-B", "-X", "utf8", str(ZYGOTE), json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env={}, cwd=str(base),
                close_fds=True, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self._sock, self._base = mine, base

    def _cleanup(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
        self._proc = self._sock = self._base = None

    def close(self) -> None:
        """Ends the zygote (and any run still going) and removes its files."""
        with self._lock:
            if self._owner == os.getpid():
                self._cleanup()

    def _log(self) -> str:
        try:
            return (self._base / "zygote.log").read_text(errors="replace")[-800:] if self._base else ""
        except OSError:
            return ""

    def _send(self, msg: str, fds: list[int]) -> None:
        try:
            socket.send_fds(self._sock, [msg.encode()], fds)
        except OSError as e:
            raise ZygoteError(f"warm sandbox: the zygote is gone ({e}); {self._log().strip()}") from None

    # ---- one run --------------------------------------------------------------------------
    def run(self, request: dict, deadline: float, max_bytes: int) -> RawRun:
        payload = json.dumps(request).encode("utf-8")
        req = os.memfd_create("megarl-sandbox-request")
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, status
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(req, view):]
            with self._lock:
                self._ensure()
                self._next += 1
                run_id = self._next
                self._send(f"run {run_id}", [req, *(w for _, w in pipes)])
        finally:
            os.close(req)
            for _, w in pipes:
                os.close(w)
        try:
            raw = _pump([r for r, _ in pipes], deadline, max_bytes)
        finally:
            for r, _ in pipes:
                os.close(r)
        if raw.status is None or raw.overflow:
            with self._lock, contextlib.suppress(ZygoteError):
                if self._sock is not None and self._owner == os.getpid():
                    self._send(f"kill {run_id}", [])
            if not (raw.timed_out or raw.overflow):  # the program cannot reach its pid 1 or C: a sandbox failure
                raise ZygoteError(f"warm sandbox: the run ended without a status (the zygote or the run's pid 1 "
                                  f"died); {raw.stderr.strip()[-300:]} {self._log().strip()}")
        failed = raw.status is None or (os.WIFEXITED(raw.status) and os.WEXITSTATUS(raw.status) == _LAUNCHER_FAILED)
        if failed and raw.stderr.startswith("[sandbox-launcher]"):
            raise ZygoteError(f"warm sandbox could not start the program: {raw.stderr.strip()[:500]}")
        return raw


def _pump(fds: list[int], deadline: float, max_bytes: int) -> RawRun:
    """Reads stdout / stderr / status (module docstring)."""
    out_fd, err_fd, st_fd = fds
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    status_bytes = bytearray()
    timed_out = overflow = False
    exited_at = None
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if exited_at is not None and now - exited_at > 0.5:
                break  # a leftover process holds the pipes open; the kill ends it
            remaining = deadline - now
            if remaining <= 0:
                timed_out = exited_at is None
                break
            for key, _ in sel.select(min(remaining, 0.5) if exited_at else remaining):
                chunk = os.read(key.fd, 65536)
                if key.fd == st_fd:
                    status_bytes += chunk
                    if not chunk or len(status_bytes) >= STATUS.size:
                        sel.unregister(st_fd)
                        exited_at = time.monotonic()
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                room = max_bytes - len(bufs[key.fd])
                bufs[key.fd] += chunk[:room]
                if len(chunk) > room:
                    overflow = True
            if overflow:
                break
    status, cpu = (STATUS.unpack(bytes(status_bytes[: STATUS.size])) if len(status_bytes) >= STATUS.size
                   else (None, 0.0))
    out, err = (bytes(b).decode("utf-8", "replace") for b in bufs.values())
    return RawRun(out, err, status, cpu, timed_out, overflow)
