"""Every tool under tools/ answers `--help` run as a file (`python tools/bench/rollout.py --help`, from
another folder, with nothing on PYTHONPATH) and as a module (`python -m tools.bench.rollout --help`),
and writes nothing; run as a file, gpu_smoke's check that imports `tools.smoke` passes.

Most of a run's time is importing torch, so: the file runs (the way that used to fail, and that
needs a fresh interpreter to show a path problem) are one process each, in parallel; the module runs
share one process that runs each tool the way `python -m` does (`runpy.run_module` as `__main__`,
argv `[path, "--help"]`), in parallel with those."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tools").rglob("*.py") if not p.name.startswith("_"))
SMOKE_AS_FILE = ("tools/gpu_smoke.py", "--only", "logits_local")  # its model check imports tools.smoke
MODULE_RUNS = """
import contextlib, io, json, os, runpy, sys
results, names = {}, sys.argv[1:]
for name in names:
    sys.argv, out, err, code = [name, "--help"], io.StringIO(), io.StringIO(), 0  # argv[0]: the module's path
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)  # what python -m does
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code = repr(e)
    results[name] = [code, out.getvalue(), err.getvalue(), sorted(os.listdir("."))]
    for left in os.listdir("."):  # charged to this tool; the next one starts clean
        os.rename(left, f"../{name}.{left}.left")
print(json.dumps(results))
"""


def module_of(tool: str) -> str:
    return tool.removesuffix(".py").replace("/", ".")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(tool, "file" | "module"): (exit status, stdout, stderr, files left in the working folder)} of
    `--help`, and {SMOKE_AS_FILE: the same} of that gpu_smoke run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")

    def as_file(args):
        cwd = tmp_path_factory.mktemp("cwd")  # an unrelated folder, the repository nowhere on the path
        proc = subprocess.run([sys.executable, str(REPO / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr, sorted(os.listdir(cwd))

    def as_modules():  # as from the repository root
        cwd = tmp_path_factory.mktemp("parent") / "cwd"
        cwd.mkdir()
        proc = subprocess.run([sys.executable, "-c", MODULE_RUNS, *map(module_of, TOOLS)], cwd=cwd,
                              env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    with ThreadPoolExecutor(max_workers=(os.cpu_count() or 2) + 1) as pool:  # the module runs hold one
        modules = pool.submit(as_modules)
        files = dict(zip([(t, "--help") for t in TOOLS] + [SMOKE_AS_FILE],
                         pool.map(as_file, [(t, "--help") for t in TOOLS] + [SMOKE_AS_FILE])))
        out = {(t, "file"): files[(t, "--help")] for t in TOOLS}
        out.update({(t, "module"): tuple(modules.result()[module_of(t)]) for t in TOOLS})
        out[SMOKE_AS_FILE] = files[SMOKE_AS_FILE]
    return out


def test_every_tool_is_found():
    assert len(TOOLS) >= 20 and "tools/gpu_smoke.py" in TOOLS and "tools/bench/rollout.py" in TOOLS


@pytest.mark.parametrize("how", ["file", "module"])
@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help(runs, tool, how):
    rc, out, err, left = runs[(tool, how)]
    assert rc in (0, None) and out.startswith("usage: "), f"{how} run of {tool}: exit {rc}\n{out[-1500:]}{err[-3000:]}"
    assert left == [], f"{how} run of {tool} --help wrote {left}"


def test_gpu_smoke_run_as_a_file_finds_its_checks(runs):
    rc, out, err, _ = runs[SMOKE_AS_FILE]
    assert rc == 0 and out.strip().endswith("gpu_smoke: 1 passed, 0 failed, 0 skipped"), out[-3000:] + err[-3000:]
