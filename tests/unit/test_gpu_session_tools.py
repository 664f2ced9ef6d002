"""The GPU session's own tools run on CPU through megarl's CPU runtime (tiny shape, fp32 reference,
the local spec and the builtin engine standing where Transformer Engine and SGLang run on a GPU):
tools/bench/te_parity.py, fp8_train.py and sglang_sync.py; and their pass / fail rules."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import fp8_train, te_parity

REPO = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU expectations")


def _run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)


def test_parity_compares_bf16_with_the_fp32_reference_in_hf_naming(tmp_path):
    out = tmp_path / "parity.json"
    proc = _run("tools.bench.te_parity", ["--shapes", "tiny", "--impls", "local", "--tokens", "512",
                                          "--microbatches", "2", "--logit-rows", "64", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    c = row["candidates"]["local"]
    assert row["status"].startswith("ok") and c["microbatches"] >= 2 and row["sequences"] >= 4
    # bf16 rounding over two layers: off the fp32 reference by ~1e-2, not 0 (bf16 ran), not ~1 (a mapping bug)
    for key in ("logits", "logprobs", "grads"):
        assert 1e-4 < c[key] < 0.06, (key, c)
    assert c["worst_grad"].startswith(("model.", "lm_head")), c  # gradients carry HF names
    assert row["reference_vs_hf_grads"] < 1e-5, row  # the fp32 reference = HF transformers, name by name


def test_parity_bound():
    local = {"logits": 0.01, "logprobs": 0.004, "grads": 0.02}
    assert te_parity.verdict({"logits": 0.021, "logprobs": 0.009, "grads": 0.041}, local) == (True, [])
    ok, bad = te_parity.verdict({"logits": 0.0215, "logprobs": float("nan"), "grads": 0.03}, local)
    assert not ok and bad == ["logits 0.0215 > 0.021", "logprobs nan > 0.009"]
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])
    assert te_parity.relative_error([b], [a]) == pytest.approx(1.0)
    assert te_parity.relative_error([a + torch.tensor([0.0, 0.5])], [a]) == pytest.approx(0.1)


def test_fp8_stream_is_learnable_and_the_band_judges_the_tail(tmp_path):
    out = tmp_path / "fp8.json"
    proc = _run("tools.bench.fp8_train", ["--shape", "tiny", "--recipes", "bf16,tensorwise", "--steps", "20",
                                          "--tokens", "1024", "--seq-len", "128", "--lr", "3e-3", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    bf16, fp8 = json.loads(out.read_text())["rows"]
    assert bf16["status"] == "ok" and bf16["first"] > math.log(512) - 0.5 and bf16["first"] - bf16["tail"] > 2.0
    assert fp8["status"] == "skipped: FP8 needs Transformer Engine on a GPU"


def test_fp8_band():
    assert fp8_train.in_band(2.6, 2.5, 11.5) == (True, pytest.approx(0.92))  # 0.1 x 9.0 + 0.02
    assert not fp8_train.in_band(3.5, 2.5, 11.5)[0] and not fp8_train.in_band(float("nan"), 2.5, 11.5)[0]
    rows = fp8_train.judge([{"recipe": "bf16", "status": "ok", "first": 11.5, "tail": 2.5},
                            {"recipe": "delayed", "status": "ok", "first": 11.5, "tail": 2.6},
                            {"recipe": "blockwise", "status": "ok", "first": 11.5, "tail": 11.0},
                            {"recipe": "mxfp8", "status": "refused: model.fp8_recipe=mxfp8: ..."}])
    assert [r["status"].split(":")[0] for r in rows] == ["ok", "ok", "FAIL", "refused"]
    assert rows[1]["delta"] == pytest.approx(0.1)
    # the rule stream: a permutation of the first min(1000, V) tokens, one token in ten random
    import random

    seq = fp8_train.rule_sequence(random.Random(0), 400, 151936)
    follows = sum((7 * a + 13) % 1000 == b for a, b in zip(seq, seq[1:]))
    assert 0.7 * 399 < follows < 0.9 * 399


def test_weight_sync_loop_runs_with_the_builtin_engine(tmp_path):
    out = tmp_path / "sync.json"
    proc = _run("tools.bench.sglang_sync", ["--shapes", "tiny", "--engine", "builtin", "--repeats", "2",
                                            "--bucket-mb", "1", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["greedy_same"] and len(row["update_all_s"]) == 2 and row["update_s"] > 0


def test_engine_arguments():
    from tools.bench import sglang_sync

    assert sglang_sync.parse_server_args(["attention_backend=triton", "disable_cuda_graph=true", "x=0.3"]) == {
        "attention_backend": "triton", "disable_cuda_graph": True, "x": 0.3}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        sglang_sync.parse_server_args(["triton"])
    kw = sglang_sync.engine_kwargs("sglang", Path("/m"), 0.3, {"attention_backend": "triton"})
    assert kw == {"model_path": "/m", "load_format": "dummy", "dtype": "bfloat16", "mem_fraction_static": 0.3,
                  "random_seed": 0, "attention_backend": "triton"}
    assert sglang_sync.engine_kwargs("builtin", Path("/m"), 0.3, {"a": 1}) == {}
