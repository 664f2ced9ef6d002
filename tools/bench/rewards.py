"""Reward throughput on this machine: math verifier checks/s and sandbox runs/s.

    python -m tools.bench.rewards [--seconds 5] [--threads 4]

Math: `megarl.rewards.math.check` on the DAPO-17k sample golds answered in the `Answer:` format
(integers: the fast path, no subprocess), and the math-verify worker pool on the MATH-500 LaTeX
golds (the cost of every check that reaches math-verify), both from a thread pool. Sandbox: a
small stdin/stdout program, sequential and from a thread pool, on the warm zygote path (the
default where it runs: namespaces and a root caller) and on the fresh launcher per run; then the
escape probes of tests/unit/test_sandbox.py on the warm path, each of which must stay contained.
Each measurement runs for about --seconds.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.rewards`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle, islice
from pathlib import Path


from megarl.rewards import sandbox  # noqa: E402
from megarl.rewards.math import check  # noqa: E402
from megarl.rewards.math_answer import as_integer, normalize  # noqa: E402
from megarl.rewards.math_pool import VerifyPool  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"


def _golds(name: str) -> list[str]:
    return [json.loads(line)["answer"] for line in (DATA / name).read_text().splitlines()]


def _rate(fn, items: list, seconds: float, threads: int) -> tuple[float, int]:
    """Calls fn over items (cycled) in chunks until `seconds` pass; returns (calls/s, calls)."""
    done, start = 0, time.monotonic()
    chunk = max(threads * 4, 8)
    source = cycle(items)
    with ThreadPoolExecutor(max_workers=threads) as ex:
        while time.monotonic() - start < seconds:
            batch = list(islice(source, chunk))
            results = list(ex.map(fn, batch))
            if not all(results):
                raise SystemExit(f"benchmark: {results.count(False)} checks gave a wrong result")
            done += len(batch)
    return done / (time.monotonic() - start), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each measurement")
    ap.add_argument("--threads", type=int, default=4, help="caller threads")
    ap.add_argument("--math-workers", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

    pool = VerifyPool(size=args.math_workers)
    t0 = time.monotonic()
    pool.warmup()
    print(f"math-verify pool: {args.math_workers} workers started in {time.monotonic() - t0:.1f}s")
    ints = [(f"Reasoning...\nAnswer: {g}", g) for g in _golds("dapo_math_17k_sample.jsonl")]
    rate, n = _rate(lambda rg: check(rg[0], rg[1], pool=pool).correct, ints, args.seconds, args.threads)
    print(f"math verifier, integer fast path (DAPO-17k golds): {rate:,.0f} checks/s ({n} checks)")
    latex = [normalize(g) for g in _golds("math500.jsonl") if as_integer(normalize(g)) is None]
    rate, n = _rate(lambda g: pool.verify(g, g, 10.0), latex, args.seconds, args.threads)
    print(f"math verifier, math-verify path (MATH-500 LaTeX golds): {rate:,.0f} checks/s ({n} checks)")
    pool.close()

    t0 = time.monotonic()
    mode = sandbox.isolation()
    print(f"sandbox isolation: {mode} (probe {time.monotonic() - t0:.2f}s)")
    code = "import sys\nprint(sum(map(int, sys.stdin.read().split())))"
    paths = [("warm", True), ("fresh", False)] if sandbox._warm_wanted(mode, None) else [("fresh", False)]
    for name, warm in paths:
        run = lambda i: sandbox.run_python(code, stdin=f"{i} 1", warm=warm).stdout == f"{i + 1}\n"  # noqa: E731
        for threads in (1, args.threads):
            rate, n = _rate(run, list(range(100)), args.seconds, threads)
            print(f"sandbox ({name}), {threads} thread(s): {rate:.1f} runs/s ({n} runs)")
    if paths[0][0] == "warm":
        contained = [(probe, ok()) for probe, ok in _escape_probes()]
        for probe, ok in contained:
            print(f"sandbox (warm) escape probe {probe}: {'contained' if ok else 'ESCAPED'}")
        if not all(ok for _, ok in contained):
            raise SystemExit("benchmark: an escape probe was not contained on the warm path")


def _escape_probes():
    """(name, () -> contained?) of the escape probes of tests/unit/test_sandbox.py, warm path."""
    import socket
    import uuid

    repo = Path(__file__).resolve().parents[2]
    run = lambda code, **kw: sandbox.run_python(code, warm=True, **kw)  # noqa: E731
    name = f"pwned-{uuid.uuid4().hex}"

    def network():
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        server.close()
        return r.status == "error" and "connected" not in r.stdout

    def read_project():
        r = run(f"print(open({str(repo / 'pyproject.toml')!r}).read())")
        return "[build-system]" not in r.stdout

    def write_host():
        run(f"open({str(repo / name)!r}, 'w').write('x')")
        return not (repo / name).exists()

    def fork_bomb():
        code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        return run(code, limits=sandbox.Limits(timeout_s=2.0, nproc=16)).status == "timeout"

    def memory_bomb():
        return run("x = bytearray(4 * 1024**3)", memory_mb=256).status == "memory"

    def capabilities():
        code = ("import ctypes\nlibc = ctypes.CDLL(None)\nh = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
                "d = (ctypes.c_uint32 * 6)()\nlibc.capget(h, d)\nprint(sum(d), sum(libc.prctl(23, c, 0, 0, 0) == 1 "
                "for c in range(41)))")
        return run(code).stdout.split() == ["0", "0"]

    return [("network", network), ("read project files", read_project), ("write host files", write_host),
            ("fork bomb", fork_bomb), ("memory bomb", memory_bomb), ("capabilities", capabilities)]


if __name__ == "__main__":
    main()
