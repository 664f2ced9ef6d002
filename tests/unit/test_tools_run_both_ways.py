"""Every tool under tools/ answers `--help` run as a file (`python tools/bench/rollout.py --help`, from
any folder, with nothing on PYTHONPATH) and as a module (`python -m tools.bench.rollout --help`), and
writes nothing; run as a file, gpu_smoke's check that imports `tools.smoke` passes. The runs go in
parallel: most of their time is importing torch."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tools").rglob("*.py") if not p.name.startswith("_"))


def module_of(tool: str) -> str:
    return tool.removesuffix(".py").replace("/", ".")


SMOKE_AS_FILE = ("tools/gpu_smoke.py", "file", "--only", "logits_local")  # its model check imports tools.smoke


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(tool, "file" | "module", *args): (exit status, stdout, stderr, files left in the working folder)}
    for --help of every tool both ways, and SMOKE_AS_FILE."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")

    def run(job):
        tool, how, *args = job
        cwd = tmp_path_factory.mktemp("cwd")
        if how == "file":  # from an unrelated folder, the repository nowhere on the path
            cmd, env = [sys.executable, str(REPO / tool), *args], base
        else:  # as from the repository root
            cmd, env = [sys.executable, "-m", module_of(tool), *args], {**base, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        return job, (proc.returncode, proc.stdout, proc.stderr, sorted(os.listdir(cwd)))

    jobs = [SMOKE_AS_FILE] + [(tool, how, "--help") for tool in TOOLS for how in ("file", "module")]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(run, jobs))


def test_every_tool_is_found():
    assert len(TOOLS) >= 20 and "tools/gpu_smoke.py" in TOOLS and "tools/bench/rollout.py" in TOOLS


@pytest.mark.parametrize("how", ["file", "module"])
@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help(runs, tool, how):
    rc, out, err, left = runs[(tool, how, "--help")]
    assert rc == 0 and out.startswith("usage: "), f"{how} run of {tool}: exit {rc}\n{out[-1500:]}{err[-3000:]}"
    assert left == [], f"{how} run of {tool} --help wrote {left}"


def test_gpu_smoke_run_as_a_file_finds_its_checks(runs):
    rc, out, err, _ = runs[SMOKE_AS_FILE]
    assert rc == 0 and out.strip().endswith("gpu_smoke: 1 passed, 0 failed, 0 skipped"), out[-3000:] + err[-3000:]
