"""tools/gpu_smoke.py and tools/bench_train.py run on CPU: the CPU-runnable smoke checks pass
through megarl's CPU runtime, every GPU-only one reports SKIP, and the benchmark prints its
figures for a tiny shape."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
CPU_CHECKS = {"imports", "logits_local", "train_local"}
GPU_CHECKS = {"logits_te", "train_te", "offload", "nccl", "sglang", "fp8", "cp2"}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU expectations (on a GPU node run tools/gpu_smoke.py itself)")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_smoke_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run(["tools/gpu_smoke.py", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(re.findall(r"^check (\w+): (PASS|FAIL|SKIP)\b", proc.stdout, flags=re.M))
    assert set(lines) == CPU_CHECKS | GPU_CHECKS, proc.stdout
    assert {n: lines[n] for n in CPU_CHECKS} == {n: "PASS" for n in CPU_CHECKS}, proc.stdout
    assert {n: lines[n] for n in GPU_CHECKS} == {n: "SKIP" for n in GPU_CHECKS}, proc.stdout
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0 and not report["cuda"]
    assert {r["name"]: r["status"] for r in report["results"]} == lines
    details = {r["name"]: r["detail"] for r in report["results"]}
    assert "megatron-core 0.16.1" in details["imports"]
    # the numbers behind the PASSes are in the details
    diff = float(re.search(r"max\|megatron - HF\| (\S+)", details["logits_local"]).group(1))
    assert diff < 1e-3
    assert re.search(r"mean logp after the step \+\d", details["train_local"]), details["train_local"]


def _load_tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"megarl_tools_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_smoke_registry_matches():
    smoke = _load_tool("gpu_smoke")
    assert [c.name for c in smoke.CHECKS][:2] == ["imports", "logits_local"]
    assert {c.name for c in smoke.CHECKS if c.gpu_only} == GPU_CHECKS
    assert {c.name for c in smoke.CHECKS if not c.gpu_only} == CPU_CHECKS


def test_gpu_smoke_only_skip_and_failure_exit_code(tmp_path):
    proc = _run(["tools/gpu_smoke.py", "--only", "imports,nccl", "--require", "sglang"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = dict(re.findall(r"^check (\w+): (PASS|FAIL|SKIP)\b", proc.stdout, flags=re.M))
    assert lines == {"imports": "FAIL", "nccl": "SKIP"}, proc.stdout
    assert re.search(r"^check imports: FAIL missing: sglang", proc.stdout, flags=re.M), proc.stdout


def test_bench_train_tiny_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["tools/bench_train.py", "--shape", "tiny", "--seq", "128", "--steps", "1",
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = re.search(r"^bench impl=local shape=tiny seq=128 .*$", proc.stdout, flags=re.M)
    assert line, proc.stdout
    tokens_per_s = float(re.search(r"tokens_per_s=([0-9.]+)", line.group(0)).group(1))
    assert tokens_per_s > 0
    assert "mfu=n/a" in line.group(0)
    rows = json.loads(out.read_text())["rows"]
    local = next(r for r in rows if r["impl"] == "local")
    assert local["status"] == "ok" and local["microbatches"] == 4 and local["step_s"] > 0
    assert next(r for r in rows if r["impl"] == "te")["status"].startswith("skipped")


def test_bench_flops_formula():
    """P matches the HF parameter count minus norms, biases and the (tied) embedding lookup."""
    bench = _load_tool("bench_train")
    cfg = bench.hf_config("0.5b", 4096)
    assert bench.matmul_params(cfg) == 493_961_216  # Qwen2.5-0.5B: 494,032,768 params in all
    # one 4096-token sequence: 6 P N + 12 layers (heads * head_dim) N^2
    assert bench.step_flops(cfg, [4096], True) == 6.0 * 493_961_216 * 4096 + 12.0 * 24 * 896 * 4096**2
    assert bench.step_flops(cfg, [4096], False) == bench.step_flops(cfg, [4096], True) / 3
