"""Everything around the GPU calls of tools/bench/gpu_session.sh, on CPU: every step's command line
is one its tool (or the config) accepts, the deadline and step selection, the seeding of a
quickstart with another's SFT result, the wheel folder, the report's table, and the wrapper run
end to end with nothing to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tools.bench import gpu_report, gpu_session, gpu_wheels
from tools.bench.gpu_session import Record, Step

REPO = Path(__file__).resolve().parents[2]


def _tool_args(step: Step) -> list[str]:
    assert step.argv[1] == "-m"
    return step.argv[3:]


def test_every_step_is_a_command_its_tool_accepts(tmp_path):
    from megarl.config import load_config
    from megarl.models.fp8 import RECIPES
    from megarl.quickstart import DEFAULT_CONFIG
    from tools import gpu_smoke
    from tools.bench import fp8_train, sglang_sync, te_parity, train

    steps = {s.name: s for s in gpu_session.all_steps(tmp_path, "python3")}
    assert list(steps) == ["smoke", "parity", "fp8", "rl_te", "rl_fp8_tis", "rl_fp8", "bench_1.5b", "rl_sglang",
                           "sglang_smoke", "weight_sync", "bench_0.5b", "bench_3b"]
    for name in ("smoke", "sglang_smoke"):
        args = gpu_smoke.parse_args(_tool_args(steps[name]))
        assert gpu_smoke.selected(args) and args.json == f"{tmp_path}/{name}.json"
    kwargs = gpu_smoke.parse_args(_tool_args(steps["sglang_smoke"])).sglang_arg
    assert {k: json.loads(v) for k, v in (a.split("=", 1) for a in kwargs)} == gpu_session.SGLANG_ARGS
    assert {c.name for c in gpu_smoke.selected(gpu_smoke.parse_args(_tool_args(steps["smoke"])))} == {
        "imports", "logits_te", "train_te", "offload", "offload_plain", "fp8", "gdn_kernels", "fp8_weights"}
    assert te_parity.parse_args(_tool_args(steps["parity"])).shapes == "tiny,0.5b,1.5b"
    fp8 = fp8_train.parse_args(_tool_args(steps["fp8"]))
    assert fp8.recipes.split(",") == ["bf16", *RECIPES] and fp8.steps == 50
    assert sglang_sync.parse_args(_tool_args(steps["weight_sync"])).server_args == gpu_session.SGLANG_ARGS
    for shape in ("1.5b", "0.5b", "3b"):
        b = train.parse_args(_tool_args(steps[f"bench_{shape}"]))
        assert b.shape == shape and b.fp8 == "none,tensorwise" and b.impl == "local,te"
    # the quickstarts: the config they load (the quickstart's default preset + the overrides) is valid
    seen = {}
    for name in ("rl_te", "rl_fp8_tis", "rl_fp8", "rl_sglang"):
        argv = steps[name].argv
        assert argv[1:6] == ["-m", "megarl.cli", "quickstart", "--nproc", "1"]
        cfg = load_config(str(DEFAULT_CONFIG), argv[6:])
        assert cfg.model.transformer_impl == "transformer_engine" and cfg.model.dtype == "bf16"
        assert cfg.trainer.run_dir == steps[name].run_dir
        seen[name] = cfg
    assert seen["rl_te"].model.fp8 is None and seen["rl_te"].rollout.engine == "builtin"
    assert (seen["rl_fp8_tis"].model.fp8, seen["rl_fp8_tis"].algorithm.rollout_is) == ("hybrid", "tis")
    assert (seen["rl_fp8"].model.fp8, seen["rl_fp8"].algorithm.rollout_is) == ("hybrid", None)
    assert seen["rl_sglang"].rollout.engine == "sglang"
    assert seen["rl_sglang"].rollout.sglang_server_args == gpu_session.SGLANG_ARGS
    assert {steps[n].seed_from for n in ("rl_fp8_tis", "rl_fp8", "rl_sglang")} == {steps["rl_te"].run_dir}


def test_steps_are_selected_by_step_or_phase_in_priority_order(tmp_path):
    steps = gpu_session.all_steps(tmp_path)
    names = lambda sel: [s.name for s in gpu_session.select(steps, sel)]  # noqa: E731
    assert names([]) == [s.name for s in steps]
    assert names(["bench_3b", "sglang"]) == ["rl_sglang", "sglang_smoke", "weight_sync", "bench_3b"]
    with pytest.raises(SystemExit, match=r"unknown steps / phases \['vllm'\]"):
        gpu_session.select(steps, ["vllm"])


def test_a_step_starts_only_if_its_estimate_fits_the_deadline(tmp_path):
    clock = [1000.0]
    ran = []

    def runner(step, work, deadline, env):  # a step "takes" its estimate
        ran.append((step.name, deadline))
        clock[0] += step.estimate
        return Record(step.name, step.phase, "ok", seconds=step.estimate, estimate=step.estimate)

    steps = [Step("a", "p", ["x"], 50, 99), Step("b", "p", ["x"], 40, 99), Step("c", "q", ["x"], 20, 99),
             Step("d", "q", ["x"], 5, 99)]
    records = gpu_session.run(steps, tmp_path, 1080.0, {}, clock=lambda: clock[0], runner=runner)
    # a: 1000 + 50 <= 1080 runs; b: 1050 + 40 > 1080 skipped; c: 1050 + 20 runs; d: 1070 + 5 runs
    assert [r.name for r in records if r.status == "ok"] == ["a", "c", "d"]
    assert records[1].status == "not run: 30 s left, needs ~40"
    assert all(d == 1080.0 for _, d in ran)
    records[2].status = "failed (rc 1)"
    assert gpu_session.next_command(records, ".whl") == "bash tools/bench/gpu_session.sh --wheels .whl b c"
    assert gpu_session.next_command(records[:1], ".whl") is None


def test_a_step_is_killed_at_the_deadline_and_keeps_its_log(tmp_path):
    import time

    step = Step("slow", "p", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], 1, 60)
    rec = gpu_session.run_step(step, tmp_path, time.time() + 2, dict(os.environ))
    assert rec.status.startswith("timeout") and rec.seconds < 10
    assert "started" in (tmp_path / "slow.log").read_text()
    ok = gpu_session.run_step(Step("quick", "p", [sys.executable, "-c", "raise SystemExit(3)"], 1, 60), tmp_path,
                              time.time() + 60, dict(os.environ))
    assert ok.status == "failed (rc 3)"


def test_a_quickstart_is_seeded_with_a_finished_sft_only(tmp_path):
    src, dst = tmp_path / "qs_te", tmp_path / "qs_fp8"
    for part in gpu_session.SEEDED + ("rl_checkpoints",):
        (src / part).mkdir(parents=True)
        (src / part / "f").write_text(part)
    assert not gpu_session.seed_quickstart(src, dst) and not dst.exists()  # no sft_done.json: SFT unfinished
    (src / "sft_actor" / "sft_done.json").write_text("{}")
    assert gpu_session.seed_quickstart(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == sorted(gpu_session.SEEDED)  # not the RL outputs
    assert (dst / "sft_actor" / "sft_done.json").exists()


def _wheel(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.py", "x = 1\n")
    return path


def test_wheel_folder_keeps_one_version_of_each_distribution(tmp_path):
    shared = tmp_path / "gpu"
    _wheel(shared / "wheels", "pydantic-2.14.4-py3-none-any.whl")
    _wheel(shared / "wheels", "transformer_engine_cu13-2.11.0-py3-none-manylinux_2_28_x86_64.whl")
    _wheel(shared / "sglang" / "wheels", "pydantic-2.14.4-py3-none-any.whl")  # the same, in both sets
    _wheel(shared / "sglang" / "wheels", "sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl")
    (shared / "sglang" / "stubs" / "IPython").mkdir(parents=True)
    (shared / "sglang" / "stubs" / "IPython" / "__init__.py").write_text("")
    pypi = tmp_path / "pypi"
    _wheel(pypi, "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl")
    out = tmp_path / ".whl"
    wheels = gpu_wheels.assemble(shared, out, [pypi])
    assert [w.name for w in wheels] == ["pydantic", "sglang", "torch_memory_saver", "transformer_engine_cu13"]
    assert sorted(p.name for p in out.glob("*.whl")) == sorted(w.path.name for w in wheels)
    assert (out / "stubs" / "IPython" / "__init__.py").exists()
    assert len((out / "MANIFEST.txt").read_text().splitlines()) == 4
    _wheel(pypi, "pydantic-2.12.0-py3-none-any.whl")
    with pytest.raises(ValueError, match=r"two versions of pydantic: pydantic-2.14.4-.*pydantic-2.12.0-"):
        gpu_wheels.assemble(shared, out, [pypi])


def test_wheel_names():
    w = gpu_wheels.parse_wheel(Path("latex2sympy2_extended-1.11.0-py3-none-any.whl"))
    assert (w.name, w.version) == ("latex2sympy2_extended", "1.11.0")
    assert gpu_wheels.parse_wheel(Path("foo_bar-1.0-1-py3-none-any.whl")).name == "foo_bar"  # a build tag
    assert gpu_wheels.normalise("antlr4-python3-runtime") == gpu_wheels.normalise("antlr4_python3.runtime")
    with pytest.raises(ValueError, match="not a wheel file name"):
        gpu_wheels.parse_wheel(Path("sglang-0.5.17.tar.gz"))


def test_report_reads_every_step_output(tmp_path):
    (tmp_path / "device.txt").write_text("GPU 0: NVIDIA H100 80GB HBM3\n")
    (tmp_path / "session.json").write_text(json.dumps({"records": [
        {"name": "parity", "phase": "parity", "status": "ok", "seconds": 41.5, "estimate": 60, "argv": []},
        {"name": "bench_3b", "phase": "bench", "status": "not run: 20 s left, needs ~80", "seconds": 0.0,
         "estimate": 80, "argv": []}], "next": "bash tools/bench/gpu_session.sh --wheels .whl bench_3b"}))
    (tmp_path / "parity.json").write_text(json.dumps({"bound": "TE <= 2.0 x local bf16 + 0.001", "rows": [
        {"shape": "0.5b", "sequences": 9, "tokens": 8000, "status": "ok", "candidates": {
            "local": {"logits": 0.004, "logprobs": 0.002, "grads": 0.01, "worst_grad": "lm_head.weight",
                      "worst_grad_error": 0.02, "backend": ""},
            "transformer_engine": {"logits": 0.005, "logprobs": 0.002, "grads": 0.012, "worst_grad": "x",
                                   "worst_grad_error": 0.03, "backend": "FusedAttention sub-backend 1 (thd)"}}}]}))
    (tmp_path / "fp8.json").write_text(json.dumps({"shape": "0.5b", "steps": 50, "rows": [
        {"recipe": "bf16", "status": "ok", "first": 11.9, "tail": 2.5, "step_s": 0.12},
        {"recipe": "delayed", "status": "ok", "first": 11.9, "tail": 2.6, "step_s": 0.09, "delta": 0.1, "band": 0.96},
        {"recipe": "mxfp8", "status": "refused: model.fp8_recipe=mxfp8: MXFP8 block scaling needs compute capability 10.x"}]}))
    (tmp_path / "rl_fp8_tis.log").write_text("x\nquickstart: accuracy_before=0.3 accuracy_after=0.7 wall_s=31.0 run_dir=/q\n")
    (tmp_path / "rl_fp8_tis_metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "rollout/logprob_mismatch": m, "rollout/logprob_mismatch_max": 0.5,
                            "time/weight_sync": 0.02}) + "\n" for i, m in enumerate([0.01, 0.03])))
    (tmp_path / "weight_sync.json").write_text(json.dumps({"rows": [
        {"shape": "1.5b", "engine": "sglang", "weights_gb": 3.09, "status": "ok", "update_s": 0.8, "gb_per_s": 3.86,
         "update_all_s": [0.8, 0.7, 0.9], "first_update_s": 2.0, "release_s": 0.1, "resume_s": 0.2, "start_s": 20.0,
         "greedy_same": True}]}))
    (tmp_path / "bench_1.5b.json").write_text(json.dumps({"rows": [
        {"shape": "1.5b", "impl": "te", "attn": "auto", "precision": "tensorwise", "seq": 16384, "microbatches": 4,
         "status": "ok", "mfu": 0.512, "step_s": 1.3, "tokens_per_s": 50000.0, "tflops": 506.0, "logprob_mfu": 0.4,
         "peak_mem_gib": 60.0}]}))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert gpu_report.main([str(tmp_path)]) == 0
    text = buf.getvalue()
    assert "GPU session: GPU 0: NVIDIA H100 80GB HBM3" in text
    assert "| step `bench_3b` | not run: 20 s left, needs ~80 | 0.0 s (estimate 80 s) |" in text
    assert "| next call | `bash tools/bench/gpu_session.sh --wheels .whl bench_3b` |" in text
    assert ("transformer_engine bf16 vs fp32: logits 0.005, log-probs 0.002, grads 0.012 (worst x 0.03), "
            "FusedAttention sub-backend 1 (thd)") in text
    assert "| fp8 0.5b `delayed` 50 steps | ok | loss 11.900 -> 2.600 (last 10), 90 ms/step, vs bf16 +0.1000 (band +-0.9600) |" in text
    assert "| fp8 0.5b `mxfp8` 50 steps | refused | refused: model.fp8_recipe=mxfp8: MXFP8 block scaling" in text
    assert ("| rl_fp8_tis (1 GPU, quickstart) | greedy 0.3 -> 0.7 | rollout/logprob_mismatch mean 0.0200 (max 0.500), "
            "weight sync 0.020 s/step over 2 logged steps; wall 31.0 s |") in text
    assert "| weight sync 1.5b (sglang, 3.09 GB bf16) | 0.800 s (3.9 GB/s) | median of 3, first 2.00 s" in text
    assert "| bench 1.5b te/auto tensorwise 16384 tok x 4 mb | MFU 51.2% |" in text
    assert "| smoke | not run | |" in text


def test_wrapper_runs_end_to_end_with_nothing_to_do(tmp_path):
    """gpu_session.sh with an empty wheel folder and no time: every step 'not run', the three files
    come back in $OUT, the table is the last thing printed."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(REPO))
    (tmp_path / "wheels").mkdir()
    proc = subprocess.run(["bash", "tools/bench/gpu_session.sh", "--wheels", str(tmp_path / "wheels"), "--budget", "0",
                           "rl", "bench_3b"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing ran: not all ok
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "report.md", "session.json"]
    session = json.loads((out / "session.json").read_text())
    assert [r["name"] for r in session["records"]] == ["rl_te", "rl_fp8_tis", "rl_fp8", "bench_3b"]
    assert all(r["status"].startswith("not run") for r in session["records"])
    assert session["next"].endswith("rl_te rl_fp8_tis rl_fp8 bench_3b")
    assert proc.stdout.rstrip().endswith("| bench | not run | |")
    with tarfile.open(out / "logs.tgz") as tar:
        assert {"session.json", "versions.txt"} <= set(tar.getnames())
