"""tools/gpu_smoke.py and tools/bench/train.py run on CPU: the CPU-runnable smoke checks pass
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
CPU_CHECKS = {"imports", "logits_local", "train_local", "attn_kernels", "gdn_kernels", "fp8_weights"}
GPU_CHECKS = {"logits_te", "train_te", "offload", "offload_plain", "nccl", "sglang", "fp8", "cp2", "attn_cp2"}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU expectations (on a GPU node run tools/gpu_smoke.py itself)")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_smoke_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run(["-m", "tools.gpu_smoke", "--json", str(out)])
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
    # CPU: the sdpa kernel equals the blockwise path (kernel outputs, gradients, model logits and grads)
    errors = dict(re.findall(r"(\w+_sdpa\w*|model_sdpa_\w+) ([0-9.e+-]+)", details["attn_kernels"]))
    assert {"kernel_sdpa_out", "kernel_sdpa_dq", "model_sdpa_logits", "model_sdpa_grads"} <= set(errors), details
    assert all(float(v) < 1e-5 for v in errors.values()), errors
    # CPU: the delta-net's torch kernels ran (their reference is the same kernel on the CPU: 0 here)
    gdn = dict(re.findall(r"(torch_\w+) ([0-9.e+-]+)", details["gdn_kernels"]))
    assert set(gdn) == {"torch_conv", "torch_rule"} and all(float(v) <= 1e-4 for v in gdn.values()), details
    assert "flash-linear-attention: CUDA only" in details["gdn_kernels"]
    # CPU: block-FP8 rounding of the bf16 weights (e4m3: a few percent), the same values as the CPU's
    fp8 = {k: float(v) for k, v in re.findall(r"(\w+_(?:round|device)) ([0-9.e+-]+)", details["fp8_weights"])}
    assert set(fp8) == {"q_proj_round", "q_proj_device", "down_proj_round", "down_proj_device"}, details
    assert all(0 < v <= 0.05 for k, v in fp8.items() if k.endswith("round")) and fp8["q_proj_device"] == 0, fp8


def _load_tool(name: str):
    import importlib

    return importlib.import_module(f"tools.{name}")


def test_gpu_smoke_registry_matches():
    smoke = _load_tool("gpu_smoke")
    assert [c.name for c in smoke.CHECKS][:2] == ["imports", "logits_local"]
    assert {c.name for c in smoke.CHECKS if c.gpu_only} == GPU_CHECKS
    assert {c.name for c in smoke.CHECKS if not c.gpu_only} == CPU_CHECKS


def test_gpu_smoke_only_skip_and_failure_exit_code(tmp_path):
    proc = _run(["-m", "tools.gpu_smoke", "--only", "imports,nccl", "--require", "sglang"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = dict(re.findall(r"^check (\w+): (PASS|FAIL|SKIP)\b", proc.stdout, flags=re.M))
    assert lines == {"imports": "FAIL", "nccl": "SKIP"}, proc.stdout
    assert re.search(r"^check imports: FAIL missing: sglang", proc.stdout, flags=re.M), proc.stdout


def test_bench_train_tiny_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["-m", "tools.bench.train", "--shape", "tiny", "--seq", "128", "--steps", "1",
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = re.search(r"^bench impl=local attn=auto precision=bf16 shape=tiny seq=128 .*$", proc.stdout, flags=re.M)
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
    bench = _load_tool("bench.train")
    cfg = bench.hf_config("0.5b", 4096)
    assert bench.matmul_params(cfg) == 493_961_216  # Qwen2.5-0.5B: 494,032,768 params in all
    # one 4096-token sequence: 6 P N + 12 layers (heads * head_dim) N^2
    assert bench.step_flops(cfg, [4096], True) == 6.0 * 493_961_216 * 4096 + 12.0 * 24 * 896 * 4096**2
    assert bench.step_flops(cfg, [4096], False) == bench.step_flops(cfg, [4096], True) / 3


def test_gpu_report_table(tmp_path):
    """tools/bench/gpu_report.py turns a session's smoke JSON, bench rows and quickstart line into one table."""
    (tmp_path / "smoke.json").write_text(json.dumps({"results": [
        {"name": "attn_cp2", "status": "PASS", "detail": "varlen_cp_out 0.004", "seconds": 1.0}]}))
    (tmp_path / "bench_1.5b.json").write_text(json.dumps({"rows": [
        {"shape": "1.5b", "impl": "local", "attn": "auto", "seq": 4096, "microbatches": 4, "status": "ok",
         "mfu": 0.3512, "step_s": 0.5, "tokens_per_s": 32768.0, "tflops": 347.3, "logprob_mfu": 0.2,
         "peak_mem_gib": 40.0},
        {"shape": "3b", "impl": "local", "attn": "auto", "seq": 16384, "microbatches": 2, "status": "OOM"}]}))
    (tmp_path / "quickstart.log").write_text("x\nquickstart: accuracy_before=0.175 accuracy_after=0.81 wall_s=101.0 run_dir=/q\n")
    (tmp_path / "device.txt").write_text("GPU 0: NVIDIA H200\n")
    report = _load_tool("bench.gpu_report")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert report.main([str(tmp_path)]) == 0
    text = buf.getvalue()
    assert "GPU session: GPU 0: NVIDIA H200" in text
    assert "| smoke `attn_cp2` | PASS | varlen_cp_out 0.004 |" in text
    assert "| bench 1.5b local/auto bf16 4096 tok x 4 mb | MFU 35.1% | step 0.500 s, 32,768 tok/s, 347 TFLOP/s" in text
    assert "| bench 3b local/auto bf16 16384 tok x 2 mb | OOM | |" in text
    assert "after SFT 0.175, after RL 0.81 | wall 101.0 s |" in text
