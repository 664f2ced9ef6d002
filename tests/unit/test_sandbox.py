"""Code sandbox: statuses, and containment of network, file reads and writes outside the work
dir, fork bombs, infinite loops and memory bombs, with the host staying responsive."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megarl.rewards import sandbox
from megarl.rewards.sandbox import Limits, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = sandbox.isolation() == "namespace"
needs_ns = pytest.mark.skipif(not NAMESPACE, reason="user namespaces unavailable here: rlimit fallback")
WARM = NAMESPACE and os.geteuid() == 0  # the warm zygote path runs here (megarl/rewards/sandbox_warm.py)


@pytest.fixture(autouse=True, params=["warm", "fresh"])
def sandbox_path(request, monkeypatch):
    """Every test runs on both paths: the warm zygote (the default where it can run) and the fresh
    launcher per run (MEGARL_SANDBOX_WARM=0)."""
    if request.param == "warm" and not WARM:
        pytest.skip("the warm path needs namespaces and a root caller")
    monkeypatch.setenv("MEGARL_SANDBOX_WARM", "1" if request.param == "warm" else "0")
    return request.param


class Ticker:
    """Measures the largest gap between 20 ms ticks of a host thread (host responsiveness)."""

    def __enter__(self):
        self.max_gap, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        last = time.monotonic()
        while not self._stop.wait(0.02):
            now = time.monotonic()
            self.max_gap, last = max(self.max_gap, now - last), now

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _sandbox_uid_processes() -> list[int]:
    """Host pids running under the sandbox's private uids (root callers only)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if sandbox._UID_BASE <= uid < sandbox._UID_BASE + sandbox._UID_COUNT:
            pids.append(int(pid))
    return pids


# ----------------------------------------------------------------------------- basics

def test_ok_stdin_stdout():
    r = run_python("import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data)))",
                   stdin="1 2 3\n4\n")
    assert (r.status, r.stdout) == ("ok", "10\n")
    assert 0 < r.elapsed_s < 5


def test_dev_nodes_work():
    r = run_python("import os\nopen('/dev/null', 'w').write('x')\n"
                   "print(len(open('/dev/urandom', 'rb').read(16)), os.urandom(4) != b'')")
    assert (r.status, r.stdout) == ("ok", "16 True\n"), r.stderr


def test_error_statuses():
    r = run_python("raise ValueError('boom')")
    assert r.status == "error" and "ValueError: boom" in r.stderr
    r = run_python("import sys; sys.exit(3)")
    assert (r.status, r.returncode) == ("error", 3)


def test_scrubbed_env_fresh_dir_and_no_inherited_fds(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2")
    leaked = open(REPO / "pyproject.toml", "rb")
    os.set_inheritable(leaked.fileno(), True)
    try:
        code = ("import os\nopen('out.txt', 'w').write('x')\n"
                "print(sorted(os.environ))\nprint(sorted(os.listdir('.')))\n"
                "fds = []\nfor fd in range(3, 256):\n"
                "    try:\n        os.fstat(fd); fds.append(fd)\n    except OSError:\n        pass\n"
                "print(fds)\nprint(os.path.expanduser('~') == os.getcwd())")
        r = run_python(code)
    finally:
        leaked.close()
    env_keys, listing, fds, home_is_cwd = r.stdout.splitlines()
    assert r.status == "ok", r.stderr
    assert "MEGARL_TEST_SECRET" not in env_keys and "hunter2" not in r.stdout
    assert eval(env_keys) == ["HOME", "LANG", "PATH", "TMPDIR"]
    assert eval(listing) == ["main.py", "out.txt"]
    assert eval(fds) == [] and home_is_cwd == "True"


# ----------------------------------------------------------------------------- containment

@pytest.mark.parametrize("mode", ["namespace", "rlimit"])
def test_network_is_blocked(mode, monkeypatch):
    if mode == "namespace" and not NAMESPACE:
        pytest.skip("user namespaces unavailable here")
    monkeypatch.setenv("MEGARL_SANDBOX_ALLOW_ROOT", "1")  # fallback test on a root machine
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'exfiltrated')\nprint('connected')")
    try:
        r = run_python(code, timeout_s=5, mode=mode)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert r.status == "error" and "connected" not in r.stdout
    assert "PermissionError" in r.stderr or "OSError" in r.stderr


@needs_ns
def test_project_and_user_files_are_invisible():
    target = REPO / "pyproject.toml"
    assert target.read_text().startswith("[build-system]")  # readable on the host
    r = run_python(f"print(open({str(target)!r}).read())")
    assert r.status == "error" and "[build-system]" not in r.stdout
    assert "FileNotFoundError" in r.stderr
    r = run_python("import os, sys\nprint(sorted(os.listdir('/')))\nprint(os.path.exists('/proc/self'))\n"
                   f"print(os.path.exists({str(REPO)!r}))")
    top, proc, repo_visible = r.stdout.splitlines()
    # only the sandbox's own read-only system tree (the Python install may live under /root)
    system = {".input", "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "root", "sandbox",
              "sbin", "tmp", "usr"}
    assert r.status == "ok" and set(eval(top)) <= system, top
    assert proc == "False" and repo_visible == "False"


@needs_ns
def test_writes_outside_the_work_dir_do_not_reach_the_host(tmp_path):
    name = f"pwned-{uuid.uuid4().hex}"
    targets = [REPO / name, tmp_path / name, Path("/tmp") / name]
    code = (f"for p in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
            "    except OSError as e:\n        print('denied', p, type(e).__name__)\n")
    r = run_python(code)
    assert r.status == "ok", r.stderr
    assert not any(t.exists() for t in targets)
    assert f"denied {REPO / name}" in r.stdout
    assert f"wrote /tmp/{name}" in r.stdout  # the sandbox's own private /tmp


def test_infinite_loop_hits_the_wall_clock_limit():
    with Ticker() as tick:
        r = run_python("while True:\n    pass", timeout_s=1.5)
    assert r.status == "timeout"
    assert 1.4 <= r.elapsed_s < 3.0
    assert tick.max_gap < 1.0


def test_cpu_time_limit_is_enforced_by_the_kernel():
    limits = Limits(timeout_s=20, cpu_s=1)
    r = run_python("while True:\n    pass", limits=limits)
    assert r.status == "timeout" and r.returncode == -signal.SIGXCPU  # not the wall clock
    assert r.elapsed_s < 20


def test_sleeping_program_times_out():
    r = run_python("import time\ntime.sleep(60)", timeout_s=1.0)
    assert r.status == "timeout" and r.elapsed_s < 2.5


def test_fork_bomb_is_contained_and_cleaned_up():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    with Ticker() as tick:
        r = run_python(code, limits=Limits(timeout_s=2.0, nproc=16))
    assert r.status == "timeout" and r.elapsed_s < 4.0
    assert tick.max_gap < 1.0
    if os.geteuid() == 0:
        deadline = time.monotonic() + 3
        while _sandbox_uid_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandbox_uid_processes() == []


def test_process_count_limit():
    """RLIMIT_NPROC counts threads too: 8 tasks = the main thread + 7 (memory is generous so
    that thread stacks and malloc arenas do not hit the address-space limit first)."""
    code = ("import threading, time\nn = 0\ntry:\n    for _ in range(200):\n"
            "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); n += 1\n"
            "except RuntimeError:\n    print('limited at', n)")
    r = run_python(code, limits=Limits(timeout_s=5, nproc=8, memory_mb=4096))
    assert r.status == "ok" and r.stdout.startswith("limited at"), (r.stdout, r.stderr[-300:])
    limited_at = int(r.stdout.split()[-1])
    assert limited_at == 7 if os.geteuid() == 0 else 0 < limited_at < 8


@pytest.mark.parametrize("code", [
    "x = bytearray(4 * 1024**3)",
    "a = []\nwhile True:\n    a.append(' ' * 10**7)",
])
def test_memory_bomb(code):
    with Ticker() as tick:
        r = run_python(code, timeout_s=10, memory_mb=256)
    assert r.status == "memory", (r.status, r.stderr[-300:])
    assert r.elapsed_s < 5.0 and tick.max_gap < 1.0


def test_output_flood_is_cut():
    limits = Limits(timeout_s=5, max_output_bytes=10_000)
    r = run_python("while True:\n    print('x' * 1000)", limits=limits)
    assert r.status == "killed" and len(r.stdout) <= 10_000 and "output limit" in r.stderr


def test_concurrent_runs_from_threads():
    code = "import sys\nprint(int(sys.stdin.read()) ** 2)"
    with ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(lambda i: run_python(code, stdin=str(i)), range(6)))
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n") for i in range(6)]


# ----------------------------------------------------------------------------- fallback

def test_rlimit_fallback_limits(monkeypatch):
    monkeypatch.setenv("MEGARL_SANDBOX_ALLOW_ROOT", "1")
    assert run_python("print(6 * 7)", mode="rlimit").stdout == "42\n"
    assert run_python("while True:\n    pass", timeout_s=1.0, mode="rlimit").status == "timeout"
    assert run_python("x = bytearray(4 * 1024**3)", memory_mb=256, mode="rlimit").status == "memory"


def test_fallback_refuses_to_run_as_root_when_python_is_private(monkeypatch):
    if os.geteuid() != 0 or sandbox._others_can_run_python():
        pytest.skip("only when root and the interpreter is unreachable for other uids")
    monkeypatch.delenv("MEGARL_SANDBOX_ALLOW_ROOT", raising=False)
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)", mode="rlimit")


def test_cleanup_stale(tmp_path):
    old, fresh = tmp_path / "megarl-sbx-old", tmp_path / "megarl-sbx-new"
    for d in (old, fresh):
        (d / "work").mkdir(parents=True)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert sandbox.cleanup_stale(str(tmp_path), older_than_s=3600) == 1
    assert not old.exists() and fresh.exists()


def test_launcher_failure_is_an_error_not_a_program_result(monkeypatch, sandbox_path):
    if sandbox_path == "warm":
        pytest.skip("the fresh launcher's exec; the warm path's set-up failure: test_sandbox_warm.py")
    spec = sandbox._spec
    monkeypatch.setattr(sandbox, "_spec", lambda *a: {**spec(*a), "argv": ["/nonexistent/python"]})
    with pytest.raises(SandboxUnavailable, match="could not start the program.*exec"):
        run_python("print(1)")


@pytest.mark.skipif(os.geteuid() != 0, reason="counts processes by the sandbox's private uids")
def test_a_killed_caller_leaves_no_sandbox_behind(tmp_path):
    import subprocess
    import sys

    caller = subprocess.Popen(
        [sys.executable, "-c", "from megarl.rewards.sandbox import isolation, run_python\n"
         "isolation()\nprint('probed', flush=True)\n"  # the probe run is over
         "run_python('import time\\ntime.sleep(60)', timeout_s=60)"],
        stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert caller.stdout.readline() == b"probed\n"
    deadline = time.monotonic() + 20
    while not _sandbox_uid_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_uid_processes(), "the sandboxed program never started"
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 5
    while _sandbox_uid_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_uid_processes() == []


@needs_ns
def test_work_dir_is_size_limited():
    code = ("n = 0\ntry:\n    for i in range(100):\n"
            "        open(f'f{i}', 'wb').write(b'x' * 4_000_000); n += 1\n"
            "except OSError as e:\n    print('full after', n, e.errno)")
    r = run_python(code, limits=Limits(timeout_s=10, tmpfs_mb=16))
    assert r.status == "ok" and r.stdout.split()[:2] == ["full", "after"], (r.stdout, r.stderr)
    assert int(r.stdout.split()[2]) <= 4 and r.stdout.split()[3] == "28"  # ENOSPC
