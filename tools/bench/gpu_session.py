"""The checks of one lent GPU, in priority order, inside a deadline, then one table (issue 46).

    bash tools/bench/gpu_session.sh --wheels .whl                      # every step that fits 8 minutes
    bash tools/bench/gpu_session.sh --wheels .whl rl_sglang bench_3b   # named steps or phases only

gpu_session.sh installs the wheel folder (tools/bench/gpu_wheels.py) and runs this. Steps, by phase:

  smoke      tools/gpu_smoke.py: imports (TE required), logits_te, train_te, offload, offload_plain, fp8
             (the checks verified on GPUs before, local spec and NCCL, are left out)
  parity     tools/bench/te_parity.py: TE spec == local spec, tiny / 0.5b / 1.5b, logits + gradients
  fp8        tools/bench/fp8_train.py: 0.5b, 50 steps per FP8 recipe vs bf16; mxfp8 refused on Hopper
  rl         the GPU quickstart with the TE spec: bf16 (rl_te), FP8 training + bf16 rollout with and
             without TIS (rl_fp8_tis, rl_fp8; seeded with rl_te's SFT result)
  sglang     the quickstart with rollout.engine=sglang (rl_sglang), the smoke test's sglang check
             (engine cycle, log-prob mismatch, tiny MoE routing replay), weight-sync times 0.5b / 1.5b
  bench      tools/bench/train.py: local / TE x bf16 / FP8 (tensorwise) x 4k / 16k, per shape: 1.5b (the
             MFU targets; after the rl phase), 0.5b and 3b (last)

A step starts only when its estimate fits before the deadline (gpu_session.sh --budget, default
420 s after it began, the install included) and is killed at the deadline; what did not run is listed with the command that
runs it next. Every step writes its log (and JSON) into the work folder; at the end $OUT gets
report.md, session.json and logs.tgz (a call brings back at most 8 files), and the table is the
last thing printed (tools/bench/gpu_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# SGLang 0.5.17 bundle (../shared/gpu/sglang/README.md): no flashinfer, no FA3, no grammar library
SGLANG_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "disable_cuda_graph": True}
RL_TE = ["parallel.tp=1", "model.transformer_impl=transformer_engine", "model.dtype=bf16", "trainer.total_steps=10",
         "trainer.eval_interval=10", "trainer.save_interval=0"]
FP8 = ["model.fp8=hybrid", "model.fp8_recipe=delayed"]
SEEDED = ("tiny_model", "task", "megatron_init", "sft_actor")  # what a quickstart reuses (megarl.quickstart)


@dataclass
class Step:
    name: str
    phase: str
    argv: list[str]
    estimate: int  # seconds expected (first sessions: a guess; session.json records what it took)
    timeout: int
    run_dir: str | None = None  # a quickstart's run dir: its metrics.jsonl is kept as <name>_metrics.jsonl
    seed_from: str | None = None  # a quickstart run dir whose SFT result this one reuses (when it exists)


@dataclass
class Record:
    name: str
    phase: str
    status: str  # ok | failed (rc N) | timeout | not run: <why>
    seconds: float = 0.0
    estimate: int = 0
    argv: list[str] = field(default_factory=list)


def sglang_overrides() -> list[str]:
    """rollout.sglang_server_args of the bundle, as one dotted override (YAML flow mapping)."""
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in SGLANG_ARGS.items())
    return [f"rollout.sglang_server_args={{{body}}}"]


def sglang_cli_args(flag: str) -> list[str]:
    """The bundle's engine arguments as repeated `flag KEY=JSON` (gpu_smoke, sglang_sync)."""
    return [a for k, v in SGLANG_ARGS.items() for a in (flag, f"{k}={json.dumps(v)}")]


def all_steps(work: Path, py: str = "python3") -> list[Step]:
    w = str(work)
    m = [py, "-m"]
    qs = m + ["megarl.cli", "quickstart", "--nproc", "1"]
    out = [
        Step("smoke", "smoke", m + ["tools.gpu_smoke", "--only", "imports,logits_te,train_te,offload,offload_plain,fp8,gdn_kernels,fp8_weights",
                                    "--require", "te", "--json", f"{w}/smoke.json", "--verbose"], 90, 200),
        Step("parity", "parity", m + ["tools.bench.te_parity", "--shapes", "tiny,0.5b,1.5b", "--json",
                                      f"{w}/parity.json"], 60, 180),
        Step("fp8", "fp8", m + ["tools.bench.fp8_train", "--shape", "0.5b", "--steps", "50", "--recipes",
                                "bf16,delayed,tensorwise,blockwise,mxfp8", "--json", f"{w}/fp8.json"], 60, 180),
        Step("rl_te", "rl", qs + RL_TE + [f"trainer.run_dir={w}/qs_te"], 60, 180, run_dir=f"{w}/qs_te"),
        Step("rl_fp8_tis", "rl", qs + RL_TE + FP8 + ["algorithm.rollout_is=tis", f"trainer.run_dir={w}/qs_fp8_tis"],
             40, 150, run_dir=f"{w}/qs_fp8_tis", seed_from=f"{w}/qs_te"),
        Step("rl_fp8", "rl", qs + RL_TE + FP8 + [f"trainer.run_dir={w}/qs_fp8"], 40, 150, run_dir=f"{w}/qs_fp8",
             seed_from=f"{w}/qs_te"),
        Step("rl_sglang", "sglang", qs + RL_TE + ["rollout.engine=sglang", "rollout.mem_fraction=0.3",
                                                  *sglang_overrides(), f"trainer.run_dir={w}/qs_sglang"],
             90, 240, run_dir=f"{w}/qs_sglang", seed_from=f"{w}/qs_te"),
        Step("sglang_smoke", "sglang", m + ["tools.gpu_smoke", "--only", "imports,sglang", "--require", "sglang",
                                            *sglang_cli_args("--sglang-arg"), "--json", f"{w}/sglang_smoke.json",
                                            "--verbose"], 90, 240),
        Step("weight_sync", "sglang", m + ["tools.bench.sglang_sync", "--shapes", "0.5b,1.5b",
                                           *sglang_cli_args("--server-arg"), "--json", f"{w}/weight_sync.json"], 80, 240),
    ]
    def bench(shape: str, extra: list[str], estimate: int) -> Step:
        return Step(f"bench_{shape}", "bench", m + ["tools.bench.train", "--shape", shape, "--impl", "local,te", "--fp8",
                                                    "none,tensorwise", "--seq", "4096,16384", "--steps", "2", *extra,
                                                    "--json", f"{w}/bench_{shape}.json"], estimate, 240)

    # the 1.5b rows hold the throughput targets: before the SGLang phase; 0.5b and 3b last
    out.insert(6, bench("1.5b", ["--microbatches", "4", "--profile", "15"], 75))
    return out + [bench("0.5b", ["--microbatches", "4"], 50), bench("3b", ["--microbatches", "2", "--recompute",
                                                                            "selective"], 80)]


def select(steps: list[Step], names: list[str]) -> list[Step]:
    """The steps named (step or phase names), in priority order; all without names."""
    if not names:
        return list(steps)
    known = {s.name for s in steps} | {s.phase for s in steps}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"gpu_session: unknown steps / phases {unknown} (choose from {sorted(known)})")
    return [s for s in steps if s.name in names or s.phase in names]


def fits(step: Step, now: float, deadline: float) -> bool:
    return now + step.estimate <= deadline


def seed_quickstart(src: Path, dst: Path) -> bool:
    """Copies the parts of a finished quickstart that another one reuses (its SFT result: the
    quickstart then skips SFT); False when `src` has no finished SFT."""
    if not (src / "sft_actor" / "sft_done.json").exists():
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for part in SEEDED:
        if (src / part).exists() and not (dst / part).exists():
            shutil.copytree(src / part, dst / part)
    return True


def run_step(step: Step, work: Path, deadline: float, env: dict) -> Record:
    rec = Record(step.name, step.phase, "ok", estimate=step.estimate, argv=step.argv)
    if step.seed_from:
        seed_quickstart(Path(step.seed_from), Path(step.run_dir))
    limit = max(1.0, min(step.timeout, deadline - time.time()))
    t0 = time.time()
    with open(work / f"{step.name}.log", "w") as log:
        try:
            proc = subprocess.run(step.argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit)
            rec.status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
        except subprocess.TimeoutExpired:
            rec.status = f"timeout ({limit:.0f} s)"
    rec.seconds = round(time.time() - t0, 1)
    if step.run_dir and (Path(step.run_dir) / "metrics.jsonl").exists():
        shutil.copy(Path(step.run_dir) / "metrics.jsonl", work / f"{step.name}_metrics.jsonl")
    return rec


def run(steps: list[Step], work: Path, deadline: float, env: dict, clock=time.time, runner=run_step) -> list[Record]:
    out = []
    for step in steps:
        if not fits(step, clock(), deadline):
            out.append(Record(step.name, step.phase, f"not run: {deadline - clock():.0f} s left, needs ~{step.estimate}",
                              estimate=step.estimate, argv=step.argv))
            continue
        out.append(runner(step, work, deadline, env))
        print(f"== {out[-1].name}: {out[-1].status} in {out[-1].seconds} s (estimate {step.estimate})", flush=True)
    return out


def next_command(records: list[Record], wheels: str) -> str | None:
    todo = [r.name for r in records if r.status.startswith(("not run", "timeout", "failed"))]
    return f"bash tools/bench/gpu_session.sh --wheels {wheels} {' '.join(todo)}" if todo else None


def pack(work: Path, out: Path) -> Path:
    """Every log / JSON / metrics file of the work folder (not the run dirs) in one archive."""
    path = out / "logs.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(work.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f.name)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="*", help="step or phase names (default: all, in priority order)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    p.add_argument("--work", default="/tmp/gpu_session")
    p.add_argument("--deadline", type=float, default=None, help="unix time after which no step runs (default: now + 450 s)")
    p.add_argument("--wheels", default=".whl", help="the wheel folder (for the next command printed)")
    args = p.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    deadline = args.deadline or time.time() + 450
    steps = select(all_steps(work, sys.executable), args.steps)
    records = run(steps, work, deadline, dict(os.environ))
    command = next_command(records, args.wheels)
    (work / "session.json").write_text(json.dumps({"records": [asdict(r) for r in records], "next": command}, indent=2))
    from tools.bench import gpu_report

    shutil.copy(work / "session.json", out / "session.json")
    pack(work, out)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gpu_report.main([str(work)])
    (out / "report.md").write_text(buf.getvalue())
    print(buf.getvalue(), flush=True)
    return 0 if all(r.status == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
