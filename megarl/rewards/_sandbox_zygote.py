"""Warm sandbox zygote: the trusted half of `megarl.rewards.sandbox_warm`, run as its own process.

    python -I -B -X utf8 _sandbox_zygote.py '<json spec>'      (spec["control_fd"]: the control socket)

The fresh-launcher sandbox (`_sandbox_exec.py`) pays, for every program, a Python start-up, the
namespace set-up, a dozen bind mounts and a second Python start-up for the program itself: ~55 ms
of CPU on an idle core. The zygote pays the expensive part once and forks per run:

- launcher L (the caller's uid, host namespaces) makes the root skeleton, forks Z and writes Z's
  id maps. A root caller maps inner uids 1000..1000+1023 to the host uids 61000..62023 of the
  sandbox's uid pool, so every run still gets a private host uid (otherwise inner 1000 -> the
  caller's own uid, as in the fresh path).
- Z, the zygote, lives in new user + mount + net + ipc + uts namespaces, has built the read-only
  root (the interpreter and system libraries bound read-only, /dev/{null,zero,random,urandom},
  no /proc) and pivot_rooted into it. It reads only small messages from the control socket:
  `run <id>` with four fds (a memfd holding the request, the program's stdout / stderr pipes
  and a status pipe, all created by the caller) or `kill <id>`. Z never reads a request's
  content, so no program can find another run's code or input in its memory.
- per run Z forks C, which reads the request, unshares fresh pid + mount + net + ipc + uts
  namespaces, mounts the size-limited tmpfs work dir and /tmp, and forks G, pid 1 of the new pid
  namespace, which reaps and reports. G forks P, the program: it switches to the run's inner uid,
  writes main.py and the input files into the work dir, puts stdin (a memfd), stdout and stderr
  on fds 0-2 and closes every other fd, sets the rlimits, drops every capability (bounding,
  ambient, effective, permitted, inheritable: no exec follows to drop them), installs the same
  seccomp filter as the fresh path, scrubs the environment, and runs main.py in this already
  started interpreter as `python -I -B -X utf8 main.py` would (a fresh __main__, SystemExit and
  tracebacks as the interpreter handles them, non-daemon threads joined, atexit run).
- G writes P's wait status and CPU seconds on the status pipe; P's exit ends G, and G's exit
  ends the namespace and every process left in it. `kill <id>` (the caller's deadline or output
  limit) SIGKILLs C, whose death kills G (parent-death signal) and so the whole namespace.

Z exits, killing every run, when the control socket closes (the caller died or closed it).
"""

import atexit
import builtins
import ctypes
import io
import json
import os
import select
import signal
import socket
import struct
import sys
import threading  # imported once here, not by every program's exit (threading._shutdown)
import types

import contextlib  # noqa: F401,E402 - loaded once for the programs (the interpreter tool's runner uses them)
import traceback  # noqa: F401,E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_SAVED_PATH = list(sys.path)
sys.path.insert(0, _HERE)
import _sandbox_exec as X  # noqa: E402  (the fresh path's mounts, rlimits and seccomp filter)

sys.path[:] = _SAVED_PATH

RUN_NS = X.CLONE_NEWPID | X.CLONE_NEWNS | X.CLONE_NEWNET | X.CLONE_NEWIPC | X.CLONE_NEWUTS
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
STATUS = struct.Struct("id")  # wait status, CPU seconds of the program


def _fail(msg: str) -> None:
    X._fail(msg)


# ------------------------------------------------------------------------------ the launcher, L

def _launch(spec: dict) -> None:
    """L: skeleton, fork Z, write Z's id maps, wait for Z (its exit is L's)."""
    if os.geteuid() == 0:
        os.setgroups([])
    X._make_skeleton(spec)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    z = os.fork()
    if z:
        os.close(ready_w)
        os.close(go_r)
        os.close(spec["control_fd"])
        if os.read(ready_r, 1) == b"1":
            inner, count = spec["inner_uid"], spec["uid_count"]
            outer = spec["uid_base"] if spec.get("uid_base") is not None else os.getuid()
            outer_gid = spec["uid_base"] if spec.get("uid_base") is not None else os.getgid()
            X._write(f"/proc/{z}/setgroups", "deny")
            X._write(f"/proc/{z}/uid_map", f"{inner} {outer} {count}")
            X._write(f"/proc/{z}/gid_map", f"{inner} {outer_gid} {count}")
            os.write(go_w, b"1")
        _, status = os.waitpid(z, 0)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else X.LAUNCHER_FAILED)
    os.close(ready_r)
    os.close(go_w)
    X._libc.prctl(X.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    X._check(X._libc.unshare(X.CLONE_NEWUSER | X.CLONE_NEWNS | X.CLONE_NEWNET | X.CLONE_NEWIPC
                             | X.CLONE_NEWUTS), "unshare")
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        _fail("id maps were not written")
    os.close(ready_w)
    os.close(go_r)
    _build_base_root(spec)
    _serve(spec)


def _build_base_root(spec: dict) -> None:
    """Z's root: the fresh path's read-only binds and device nodes, empty mount points for the
    per-run tmpfs (work dir, /tmp), pivot_root, the old root detached, / read-only."""
    root = spec["rootdir"]
    X._mount(None, "/", None, X.MS_REC | X.MS_PRIVATE)
    X._mount(root, root, None, X.MS_BIND)
    for path in spec["ro_binds"]:
        X._mount(path, root + path, None, X.MS_BIND | X.MS_REC)
        X._restrict(root + path, X.MS_RDONLY)
    for node in X._DEV_NODES:
        X._mount(f"/dev/{node}", f"{root}/dev/{node}", None, X.MS_BIND)
    X._check(X._libc.syscall(155 if os.uname().machine == "x86_64" else 41,
                             root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    X._check(X._libc.umount2(b"/.old", X.MNT_DETACH), "umount old root")
    try:
        os.rmdir("/.old")
    except OSError:
        pass
    X._restrict("/", X.MS_RDONLY)
    X._libc.sethostname(b"sandbox", 7)


# ------------------------------------------------------------------------------ the zygote, Z

def _serve(spec: dict) -> None:
    """Z's loop: fork a run per `run` message, kill one per `kill`, reap; exit on EOF."""
    ctrl = socket.socket(fileno=spec["control_fd"])
    runs: dict[int, int] = {}  # run id -> pid of its C
    me = os.getpid()
    while True:
        readable, _, _ = select.select([ctrl], [], [], 0.05)
        _reap(runs)
        if not readable:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 64, 4)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the caller is gone: so are its runs
            for pid in runs.values():
                _kill(pid)
            os._exit(0)
        kind, _, ident = msg.decode().partition(" ")
        run_id = int(ident)
        if kind == "run" and len(fds) == 4:
            pid = os.fork()
            if pid == 0:
                ctrl.close()
                _run(spec, fds, me)
            runs[run_id] = pid
        elif kind == "kill" and run_id in runs:
            _kill(runs[run_id])
        for fd in fds:
            os.close(fd)


def _reap(runs: dict[int, int]) -> None:
    """Reaps every finished C (only then may its pid be reused: `kill` never hits a stranger)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for k in [k for k, v in runs.items() if v == pid]:
            del runs[k]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------ one run: C, G, P

def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _run(spec: dict, fds: list[int], zygote: int) -> None:
    """C: fresh namespaces and tmpfs for this run, then G (pid 1) -> P (the program)."""
    try:
        req_fd, out_w, err_w, status_w = fds
        X._libc.prctl(X.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != zygote:
            os._exit(X.LAUNCHER_FAILED)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        req = json.loads(_read_all(req_fd))
        os.close(req_fd)
        X._check(X._libc.unshare(RUN_NS), "unshare (run)")
        inner = spec["inner_uid"] + int(req["slot"])
        size = f"size={int(req['tmpfs_mb'])}m,nr_inodes=4096"
        X._mount("tmpfs", "/tmp", "tmpfs", X.MS_NOSUID | X.MS_NODEV, f"{size},mode=1777")
        X._mount("tmpfs", spec["cwd"], "tmpfs", X.MS_NOSUID | X.MS_NODEV, f"{size},mode=0700,uid={inner},gid={inner}")
        X._libc.sethostname(b"sandbox", 7)
        g = os.fork()
        if g:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
            os.waitpid(g, 0)
            os._exit(0)
        # G: pid 1 of the run's pid namespace
        X._libc.prctl(X.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        p = os.fork()
        if p == 0:
            _program(spec, req, inner, out_w, err_w)
        for fd in (out_w, err_w):
            os.close(fd)
        while True:  # reap orphans until the program itself exits; its exit ends the namespace
            pid, status, usage = os.wait4(-1, 0)
            if pid == p:
                os.write(status_w, STATUS.pack(status, usage.ru_utime + usage.ru_stime))
                os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported on the program's stderr, never raised into Z
        try:
            os.write(fds[2], f"[sandbox-launcher] warm run: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(X.LAUNCHER_FAILED)


def _drop_capabilities() -> None:
    """Empties the bounding and ambient sets, then effective / permitted / inheritable."""
    for cap in range(64):
        if X._libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability this kernel knows
    X._libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    X._check(X._libc.capset(header, data), "capset")


def _program(spec: dict, req: dict, inner: int, out_w: int, err_w: int) -> None:
    """P: the untrusted program, in this interpreter (module docstring). A set-up failure is
    reported on the program's stderr pipe with exit status 125, which the caller raises."""
    report = err_w
    try:
        os.setresgid(inner, inner, inner)
        os.setresuid(inner, inner, inner)
        cwd = spec["cwd"]
        os.chdir(cwd)
        for name, content in [("main.py", req["code"]), *req.get("files", {}).items()]:
            path = os.path.join(cwd, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
        stdin = os.memfd_create("stdin", 0)
        os.write(stdin, req.get("stdin", "").encode("utf-8"))
        os.lseek(stdin, 0, os.SEEK_SET)
        for fd, target in ((stdin, 0), (out_w, 1), (err_w, 2)):
            os.dup2(fd, target)
        report = 2
        os.closerange(3, 1 << 16)
        X._set_rlimits(req["limits"], nproc_base=0 if spec.get("uid_base") is not None else 1)
        _drop_capabilities()
        X._install_seccomp(allow_unix_socket=True)
    except BaseException as e:  # noqa: BLE001
        os.write(report, f"[sandbox-launcher] warm program set-up: {type(e).__name__}: {e}\n".encode())
        os._exit(X.LAUNCHER_FAILED)
    os.environ.clear()
    os.environ.update(spec["env"])
    os._exit(_interpret(os.path.join(spec["cwd"], "main.py")))


def _interpret(path: str) -> int:
    """Runs main.py as `python -I -B -X utf8 main.py` would; returns the exit status."""
    sys.stdin = sys.__stdin__ = io.open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = sys.__stdout__ = io.open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = sys.__stderr__ = io.open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                                          buffering=1)
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p != _HERE]
    if "random" in sys.modules:  # a fresh interpreter seeds from the OS; so does every run here
        sys.modules["random"].seed()
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        kind, value, tb = sys.exc_info()
        value = value.with_traceback(tb.tb_next if tb is not None else None)  # without this function's frame
        sys.excepthook(kind, value, value.__traceback__)
        code = 1
    try:
        threading._shutdown()  # joins the non-daemon threads, as interpreter shutdown does
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            code = code or 120  # the interpreter's status when flushing stdout fails
    return code


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass
    return 1


def main() -> None:
    try:
        spec = json.loads(sys.argv[1])
        _launch(spec)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - any launcher failure is reported, not raised
        _fail(f"zygote: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
