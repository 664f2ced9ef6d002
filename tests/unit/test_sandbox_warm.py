"""The warm sandbox path (megarl/rewards/sandbox_warm.py + _sandbox_zygote.py): what a forked,
already-started interpreter must add to the fresh launcher's guarantees (test_sandbox.py runs
every containment test on both paths): no capability survives, no state or file of one run
reaches the next, concurrent runs get their own uid and pid namespace, the program exits as the
interpreter would, a dead zygote is replaced, and a failed set-up is an error, not a result."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megarl.rewards import sandbox
from megarl.rewards.sandbox import SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(not (sandbox.isolation() == "namespace" and os.geteuid() == 0),
                                reason="the warm path needs user namespaces and a root caller")


def warm(code: str, **kw):
    return run_python(code, warm=True, **kw)


def test_the_warm_path_is_taken_and_fast():
    warm("print(1)")
    zygote = sandbox._zygote
    assert zygote is not None and zygote._proc.poll() is None
    t0 = time.monotonic()
    results = [warm(f"print({i} * 2)") for i in range(20)]
    assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(20)]
    assert (time.monotonic() - t0) / 20 < 0.25  # the fresh launcher: ~0.05 s idle, seconds under load
    assert sandbox._zygote is zygote  # the same zygote served them all


def test_no_capability_survives_the_fork():
    code = ("import ctypes\nlibc = ctypes.CDLL(None)\nh = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
            "d = (ctypes.c_uint32 * 6)()\nassert libc.capget(h, d) == 0\n"
            "print(list(d), sum(libc.prctl(23, c, 0, 0, 0) == 1 for c in range(64)), libc.prctl(39, 0, 0, 0, 0))")
    r = warm(code)
    assert r.status == "ok", r.stderr
    assert r.stdout.split("] ")[0] == "[0, 0, 0, 0, 0, 0"  # effective, permitted, inheritable
    assert r.stdout.split("] ")[1].split() == ["0", "1"]  # empty bounding set; no_new_privs set


def test_nothing_of_one_run_reaches_the_next():
    assert warm("import builtins, json\nbuiltins.LEAK = 1\njson.LEAK = 2\nopen('/tmp/x', 'w').write('x')\n"
                "open('left.txt', 'w').write('x')").status == "ok"
    r = warm("import builtins, json, os\nprint(hasattr(builtins, 'LEAK'), hasattr(json, 'LEAK'), "
             "os.listdir('/tmp'), sorted(os.listdir('.')))")
    assert r.stdout == "False False [] ['main.py']\n", r.stderr


def test_concurrent_runs_get_their_own_uid_and_pid_namespace():
    code = "import os, time\ntime.sleep(0.3)\nprint(os.getuid(), os.getpid(), os.getppid())"
    with ThreadPoolExecutor(4) as ex:
        outs = [r.stdout.split() for r in ex.map(lambda _: warm(code), range(4))]
    assert len({uid for uid, _, _ in outs}) == 4  # a private uid each (root caller)
    assert all((pid, ppid) == ("2", "1") for _, pid, ppid in outs)  # pid 2 under its own pid 1


def test_exit_as_the_interpreter_exits():
    r = warm("import sys\nsys.exit('bye')")
    assert (r.status, r.returncode, r.stderr) == ("error", 1, "bye\n")
    r = warm("x = (")
    assert r.status == "error" and "SyntaxError" in r.stderr and "_sandbox_zygote" not in r.stderr
    r = warm("raise KeyError('k')")
    assert r.stderr.startswith("Traceback") and "_sandbox_zygote" not in r.stderr and r.stderr.endswith("KeyError: 'k'\n")
    code = ("import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\nprint('main')")
    assert warm(code).stdout == "main\nthread\natexit\n"
    assert warm("print(__name__, __file__)").stdout == "__main__ /sandbox/main.py\n"


def test_large_stdin_and_files():
    data = "x" * 2_000_000
    r = warm("import sys\nprint(len(sys.stdin.read()), open('d/f.txt').read())", stdin=data, files={"d/f.txt": "hi"})
    assert r.stdout == "2000000 hi\n", r.stderr


def test_a_dead_zygote_is_replaced():
    import psutil

    warm("print(1)")
    old = sandbox._zygote._proc
    (z,) = psutil.Process(old.pid).children()  # the zygote itself, under its launcher
    with ThreadPoolExecutor(1) as ex:
        running = ex.submit(warm, "import time\ntime.sleep(5)")
        time.sleep(0.5)
        z.kill()
        with pytest.raises(SandboxUnavailable, match="without a status"):  # loudly, not as a program result
            running.result(timeout=10)
    old.wait(timeout=10)
    assert warm("print(3)").stdout == "3\n"  # the next run starts a new zygote
    assert sandbox._zygote._proc.pid != old.pid
    assert run_python("print(4)").stdout == "4\n"  # auto mode: still warm
    assert sandbox._warm_failures == 0


def test_a_failed_set_up_is_an_error_not_a_program_result():
    with pytest.raises(SandboxUnavailable, match="sandbox-launcher"):
        warm("print(1)", files={"main.py/x": "no"})  # main.py is a file: the program's set-up fails
