"""Run untrusted, model-written Python in an isolated child process.

    run_python(code, stdin="", timeout_s=5, memory_mb=512) -> Result(status, stdout, stderr, elapsed_s)

status: "ok" (exit 0) | "error" (non-zero exit, e.g. an exception) | "timeout" (wall or CPU
limit) | "memory" (memory limit) | "killed" (another signal, or the output limit).

Isolation (probed once per process, `isolation()`):
- "namespace": Linux user + mount + net + pid + ipc + uts namespaces, set up by the launcher
  `_sandbox_exec.py` with unshare(2)/pivot_root(2) (needs only that the kernel allows user
  namespaces; no setuid helper, nothing to install). The program sees a read-only root with
  the interpreter and system libraries, its own work dir (also HOME and cwd) and /tmp, both
  size-limited tmpfs (`tmpfs_mb` each, so no disk can fill up); no /proc, no project or user files, no network interfaces, no capabilities. When the
  caller is root, the program runs as a per-run unprivileged host uid (61000 + slot).
- "rlimit": fallback when namespaces are refused (e.g. a container without user namespaces):
  rlimits + seccomp (which still blocks socket() and other syscalls) + a fresh work dir, but
  the host filesystem stays readable. A warning is logged once.
Both: scrubbed environment, no inherited fds, setsid, CPU-time / address-space / process-count
/ file-size / open-file rlimits, a wall-clock deadline enforced here (SIGKILL to the process
group; in namespace mode that ends the whole pid namespace), capped stdout/stderr.

Warm path (namespace isolation, root caller; the default there): instead of a fresh launcher and
interpreter per run, one zygote per caller process, already inside its namespaces and read-only
root, forks a child per run that gets fresh pid / mount / net / ipc / uts namespaces, its own
tmpfs work dir and /tmp, a private host uid, the same rlimits and seccomp filter, and no
capabilities, and runs the program in the forked interpreter (`sandbox_warm.py`,
`_sandbox_zygote.py`): ~10x more runs per second. `MEGARL_SANDBOX_WARM=0` or `warm=False` keeps
the fresh launcher; a zygote that cannot start falls back to it with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_LAUNCHER = Path(__file__).with_name("_sandbox_exec.py")
_LAUNCHER_FAILED = 125
_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
_INSIDE_WORKDIR = "/sandbox"
_INNER_UID = 1000
_UID_BASE, _UID_COUNT = 61000, 1024  # unprivileged uids used when the caller is root


@dataclass
class Result:
    status: str  # ok | error | timeout | memory | killed
    stdout: str
    stderr: str
    elapsed_s: float
    returncode: int | None = None
    isolation: str = ""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `cpu_s` defaults to ceil(timeout_s); `nproc` counts processes and
    threads; `fsize_mb` caps every file the program writes; `max_output_bytes` caps each of
    stdout and stderr (exceeding it kills the program)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    cpu_s: int | None = None
    nproc: int = 32
    fsize_mb: int = 16
    nofile: int = 64
    tmpfs_mb: int = 32  # size of the work dir and of /tmp (namespace mode)
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "nproc", "fsize_mb", "nofile", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox Limits.{name} must be > 0, got {getattr(self, name)}")


class _UidPool:
    def __init__(self) -> None:
        self._free = list(range(_UID_BASE + _UID_COUNT - 1, _UID_BASE - 1, -1))
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self):
        if os.geteuid() != 0:
            yield None
            return
        with self._lock:
            if not self._free:
                raise RuntimeError("sandbox: more than 1024 concurrent runs")
            uid = self._free.pop()
        try:
            yield uid
        finally:
            with self._lock:
                self._free.append(uid)


_uids = _UidPool()
_isolation: str | None = None
_isolation_lock = threading.Lock()
_fallback_drop: bool | None = None


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run code: its launcher failed, or the fallback would have to run
    untrusted code as root."""


def _fallback_can_drop() -> bool:
    global _fallback_drop
    if _fallback_drop is None:
        _fallback_drop = _others_can_run_python()
    return _fallback_drop


def _others_can_run_python() -> bool:
    """Whether an unprivileged uid can reach the interpreter and its standard library
    (pyenv under /root, mode 0700, cannot)."""
    for target in (_PYTHON, os.path.realpath(sys.base_prefix)):
        path = Path(target)
        for d in [*reversed(path.parents), path]:
            if not os.stat(d).st_mode & (stat.S_IXOTH if d != path or path.is_dir() else stat.S_IROTH):
                return False
    return True


def _ro_binds() -> tuple[list[str], dict[str, str]]:
    """Read-only bind sources (interpreter prefix, system libraries) and top-level symlinks."""
    binds, links = [], {}
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links[top] = os.readlink(top)
        elif os.path.isdir(top):
            binds.append(top)
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == b or prefix.startswith(b + "/") for b in binds):
        binds.append(prefix)
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    return binds, links


def _spec(mode: str, base: Path, limits: Limits, uid: int | None) -> dict:
    inside = mode == "namespace"
    cwd = _INSIDE_WORKDIR if inside else str(base / "work")
    binds, links = _ro_binds()
    return {
        "mode": mode, "uid": uid, "inner_uid": _INNER_UID, "parent": os.getpid(),
        "workdir": str(base / "work"), "rootdir": str(base / "root"), "cwd": cwd,
        "ro_binds": binds, "symlinks": links,
        "argv": [_PYTHON, "-I", "-B", "-X", "utf8", "main.py"],
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8",
                "TMPDIR": "/tmp" if inside else cwd},
        "cpu_s": limits.cpu_s or max(1, math.ceil(limits.timeout_s)),
        "memory_mb": limits.memory_mb, "nproc": limits.nproc, "fsize_mb": limits.fsize_mb,
        "nofile": limits.nofile, "tmpfs_mb": limits.tmpfs_mb,
    }


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def _pump(proc: subprocess.Popen, deadline: float, max_bytes: int):
    """Reads stdout/stderr until the process exits or the deadline; returns
    (stdout, stderr, wait status or None, rusage or None, timed_out, overflow)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pidfd = os.pidfd_open(proc.pid)
    status = rusage = None
    timed_out = overflow = False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        exited_at = None
        while sel.get_map():
            now = time.monotonic()
            if exited_at is not None and now - exited_at > 0.5:
                break  # a leftover process holds the pipes open; it is killed by the caller
            remaining = deadline - now
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(remaining, 0.5) if exited_at else remaining):
                fd = key.fd
                if fd == pidfd:
                    _, status, rusage = os.wait4(proc.pid, 0)
                    exited_at = time.monotonic()
                    sel.unregister(pidfd)
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = max_bytes - len(bufs[fd])
                bufs[fd] += chunk[:room]
                if len(chunk) > room:
                    overflow = True
            if overflow:
                break
    os.close(pidfd)
    out, err = (bytes(b).decode("utf-8", "replace") for b in bufs.values())
    return out, err, status, rusage, timed_out, overflow


def _classify(status: int | None, rusage, cpu_s: int, stderr: str, timed_out: bool,
              overflow: bool) -> str:
    if overflow:
        return "killed"
    if timed_out or status is None:
        return "timeout"
    tail = stderr[-2000:]
    memory = "MemoryError" in tail or "Cannot allocate memory" in tail or "out of memory" in tail
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        cpu_used = rusage.ru_utime + rusage.ru_stime if rusage else 0.0
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_s):
            return "timeout"
        return "memory" if memory else "killed"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "ok"
    return "memory" if memory else "error"


def _run(code: str, stdin: str, limits: Limits, mode: str,
         files: dict[str, str] | None = None) -> Result:
    start = time.monotonic()
    with _uids.take() as uid, tempfile.TemporaryDirectory(prefix="megarl-sbx-") as tmp:
        if mode == "rlimit" and uid is not None and not _fallback_can_drop():
            if os.environ.get("MEGARL_SANDBOX_ALLOW_ROOT") != "1":
                raise SandboxUnavailable(
                    f"sandbox rlimit fallback: {_PYTHON} is not usable by an unprivileged uid, "
                    "so untrusted code would run as root. Enable user namespaces, install "
                    "Python outside /root, or set MEGARL_SANDBOX_ALLOW_ROOT=1 to accept this.")
            uid = None
        base = Path(tmp)
        work = base / "work"
        work.mkdir()
        (base / "root").mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        for name, content in (files or {}).items():
            if os.path.isabs(name) or ".." in Path(name).parts:
                raise ValueError(f"sandbox: file names must be relative, inside the work dir: {name!r}")
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(content, encoding="utf-8")
        stdin_path = base / "stdin"
        stdin_path.write_text(stdin, encoding="utf-8")
        if uid is not None:
            _chown_tree(base, uid)
        spec = _spec(mode, base, limits, uid)
        with open(stdin_path, "rb") as stdin_file:
            proc = subprocess.Popen(
                [_PYTHON, "-I", "-S", "-B", str(_LAUNCHER), json.dumps(spec)],
                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={}, cwd=str(base), close_fds=True, start_new_session=True,
            )
        out, err, status, rusage, timed_out, overflow = "", "", None, None, False, False
        try:
            out, err, status, rusage, timed_out, overflow = _pump(
                proc, start + limits.timeout_s, limits.max_output_bytes)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if status is None:
                with contextlib.suppress(ChildProcessError):
                    _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
            proc.stdout.close()
            proc.stderr.close()
            if mode == "rlimit" and uid is not None:
                _kill_uid(uid)
        elapsed = time.monotonic() - start
    if proc.returncode == _LAUNCHER_FAILED and err.startswith("[sandbox-launcher]"):
        raise SandboxUnavailable(f"sandbox ({mode}) could not start the program: {err.strip()[:500]}")
    result_status = _classify(status, rusage, spec["cpu_s"], err, timed_out, overflow)
    if overflow:
        err += f"\n[sandbox] output limit of {limits.max_output_bytes} bytes exceeded"
    return Result(result_status, out, err, elapsed, proc.returncode, mode)


def _kill_uid(uid: int) -> None:
    """Fallback cleanup: SIGKILL every leftover process of the run's private uid."""
    spec = json.dumps({"mode": "kill", "uid": uid})
    subprocess.run([_PYTHON, "-I", "-S", "-B", str(_LAUNCHER), spec], env={}, close_fds=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=30, check=False)


def isolation() -> str:
    """The isolation in use: "namespace" if a probe run succeeds, else "rlimit" (warned once).
    MEGARL_SANDBOX_ISOLATION=rlimit forces the fallback."""
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            forced = os.environ.get("MEGARL_SANDBOX_ISOLATION")
            if forced not in (None, "", "namespace", "rlimit"):
                raise ValueError(f"MEGARL_SANDBOX_ISOLATION must be namespace or rlimit, got {forced!r}")
            reason = "forced by MEGARL_SANDBOX_ISOLATION"
            if forced != "rlimit":
                try:
                    probe = _run("print('sandbox-probe-ok')", "", Limits(timeout_s=20), "namespace")
                    if probe.status == "ok" and probe.stdout.strip() == "sandbox-probe-ok":
                        _isolation = "namespace"
                        return _isolation
                    reason = f"namespace probe: {probe.status} {probe.stderr.strip()[-300:]}"
                except SandboxUnavailable as e:
                    reason = str(e)
            logger.warning(
                "megarl sandbox: Linux namespaces unavailable (%s); falling back to rlimits + "
                "seccomp only. Untrusted code can READ the host filesystem.", reason)
            _isolation = "rlimit"
        return _isolation


def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512, *,
               limits: Limits | None = None, files: dict[str, str] | None = None,
               mode: str | None = None, warm: bool | None = None) -> Result:
    """Runs `code` as main.py in a fresh sandbox with `stdin` as its standard input.

    `limits` overrides timeout_s / memory_mb; `files` are extra files written into the work
    dir; `mode` forces an isolation ("namespace" | "rlimit") instead of the probed one; `warm`
    picks the warm path (True; SandboxUnavailable where it cannot run) or the fresh launcher
    (False); None: warm where it can run (module docstring).
    """
    if limits is None:
        limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)
    if mode not in (None, "namespace", "rlimit"):
        raise ValueError(f"sandbox: mode must be 'namespace' or 'rlimit', got {mode!r}")
    mode = mode or isolation()
    for name in files or {}:
        if os.path.isabs(name) or ".." in Path(name).parts:
            raise ValueError(f"sandbox: file names must be relative, inside the work dir: {name!r}")
    if _warm_wanted(mode, warm):
        from megarl.rewards.sandbox_warm import ZygoteError

        global _warm_failures
        try:
            result = _run_warm(code, stdin, limits, files)
            _warm_failures = 0
            return result
        except ZygoteError as e:
            if warm:
                raise SandboxUnavailable(str(e)) from None
            _warm_failed(e)
    return _run(code, stdin, limits, mode, files)


_zygote = None
_warm_failures = 0  # consecutive zygote failures; after 3 the fresh launcher takes over


def _warm_wanted(mode: str, warm: bool | None) -> bool:
    if warm is False or (warm is None and os.environ.get("MEGARL_SANDBOX_WARM", "1") == "0"):
        return False
    ok = mode == "namespace" and os.geteuid() == 0
    if warm and not ok:
        raise SandboxUnavailable("sandbox warm path: needs namespace isolation and a root caller "
                                 "(a private host uid per run); use warm=False")
    return ok and (bool(warm) or _warm_failures < 3)


def _warm_failed(e: Exception) -> None:
    """A zygote failure in auto mode: this run goes to the fresh launcher; the next one starts a
    new zygote, unless three failed in a row (then the fresh launcher for good, warned once)."""
    global _warm_failures
    _warm_failures += 1
    logger.warning("megarl sandbox: the warm zygote failed (%s); %s", e,
                   "using the fresh launcher from now on" if _warm_failures >= 3 else "this run uses the fresh launcher")


def _zygote_spec(base: Path) -> dict:
    spec = _spec("namespace", base, Limits(), None)
    return {key: spec[key] for key in ("inner_uid", "rootdir", "cwd", "ro_binds", "symlinks", "env")} | {
        "uid_base": _UID_BASE, "uid_count": _UID_COUNT}


def _run_warm(code: str, stdin: str, limits: Limits, files: dict[str, str] | None) -> Result:
    """One run on the warm zygote (sandbox_warm.py), classified like a fresh run."""
    global _zygote
    from types import SimpleNamespace

    from megarl.rewards.sandbox_warm import Zygote

    start = time.monotonic()
    cpu_s = limits.cpu_s or max(1, math.ceil(limits.timeout_s))
    with _isolation_lock:
        if _zygote is None:
            _zygote = Zygote(_PYTHON, _zygote_spec)
    with _uids.take() as uid:
        request = {"code": code, "stdin": stdin, "files": dict(files or {}), "slot": uid - _UID_BASE,
                   "tmpfs_mb": limits.tmpfs_mb,
                   "limits": {"cpu_s": cpu_s, "memory_mb": limits.memory_mb, "nproc": limits.nproc,
                              "fsize_mb": limits.fsize_mb, "nofile": limits.nofile}}
        raw = _zygote.run(request, start + limits.timeout_s, limits.max_output_bytes)
    usage = SimpleNamespace(ru_utime=raw.cpu_s, ru_stime=0.0)
    status = _classify(raw.status, usage, cpu_s, raw.stderr, raw.timed_out, raw.overflow)
    err = raw.stderr
    if raw.overflow:
        err += f"\n[sandbox] output limit of {limits.max_output_bytes} bytes exceeded"
    returncode = -1 if raw.status is None else os.waitstatus_to_exitcode(raw.status)
    return Result(status, raw.stdout, err, time.monotonic() - start, returncode, "namespace")


def cleanup_stale(tmp_dir: str | None = None, older_than_s: float = 3600) -> int:
    """Removes sandbox temp dirs left by killed processes; returns how many."""
    root = Path(tmp_dir or tempfile.gettempdir())
    removed = 0
    for path in root.glob("megarl-sbx-*"):
        if time.time() - path.stat().st_mtime > older_than_s:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
