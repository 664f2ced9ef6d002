"""The pytest side of the distributed tests: start a worker and read its result, and the inputs
several tests share.

`run_torchrun` runs a script under torchrun with N gloo ranks and returns its JSON result
(written by rank 0). `run_worker` is the usual way in: a worker of this folder with `--root`, an
optional config and its overrides, its result at root/out.json (tests/distributed/harness.py is
the worker's half); `worker_fixture` makes a module's `results` fixture of one such run.
`run_python` runs one plain process. `tiny_model`, `rl_files` and
`rl_overrides` write and name the tiny model and task of an RL run; `convert` and friends run
tools/convert_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONVERT = REPO / "tools/convert_checkpoint.py"
# the tiny model of most tests (megarl.tasks.tiny_model.TinyModelSpec fields)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=0)
# what every tiny RL run on the arith task sets, besides the paths
TINY_RL = ["data.prompt_template=arith", "model.dtype=fp32", "model.transformer_impl=local",
           "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4", "reward.sources={arith: math}"]
# a module's pytestmark: these gloo tests compare CPU results and do not run where CUDA is
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, args: list[str], out_json: Path, timeout: int = 600,
                 strict_device: bool = True) -> dict:
    """strict_device: run under the CPU runtime's strict device mode (megarl.parallel.strict_device),
    so a tensor a GPU run would find on the wrong device fails here too."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
               MEGARL_STRICT_DEVICE="1" if strict_device else "0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), "--out", str(out_json), *args,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: killing torchrun alone would leave
        # the workers running (and holding the CPU) for the rest of the test session
        for p in [*psutil.Process(proc.pid).children(recursive=True), proc]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {script} timed out after {timeout} s; killed it and its workers:\n"
                             f"{(stdout + stderr)[-3000:]}") from None
    if proc.returncode != 0:
        text = stdout + stderr
        first = text.find("Traceback")
        head = text[first : first + 5000] if first >= 0 else ""
        errors = [ln for ln in text.splitlines() if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", ln)]
        raise AssertionError(f"torchrun {script} failed (rc={proc.returncode}):\n{head}\n...\n{text[-2000:]}\n"
                             f"exceptions raised:\n" + "\n".join(dict.fromkeys(errors)))
    return json.loads(Path(out_json).read_text())


def run_worker(script: str, nproc: int, root: Path, *args, config: str | None = None, overrides=(),
               timeout: int = 600) -> dict:
    """tests/distributed/<script> on nproc ranks (`run_torchrun`, strict device mode) with
    `--root root`, then `--config configs/<config>` when given, the worker's own options `args`
    and the config overrides; returns the JSON it wrote to root/out.json."""
    cfg = ["--config", str(REPO / "configs" / config)] if config else []
    return run_torchrun(HERE / script, nproc, ["--root", str(root), *cfg, *map(str, args), *overrides],
                        Path(root) / "out.json", timeout=timeout)


def worker_fixture(script: str, nproc: int, timeout: int = 600, name: str = "results"):
    """A module-scoped fixture called `name`: the JSON of one `run_worker` of script (no options)
    in a fresh folder, shared by the module's tests."""
    @pytest.fixture(scope="module", name=name)
    def results(tmp_path_factory):
        return run_worker(script, nproc, tmp_path_factory.mktemp(Path(script).stem), timeout=timeout)

    return results


def run_python(script: str, root: Path, timeout: int, env: dict) -> dict:
    """tests/distributed/<script> as one plain process (no torchrun) with `--out root/out.json
    --root root` and exactly the environment `env`; it must exit 0. Returns the JSON it wrote."""
    out = Path(root) / "out.json"
    proc = subprocess.run([sys.executable, str(HERE / script), "--out", str(out), "--root", str(root)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def tiny_model(path: Path, **spec) -> Path:
    """Saves the tiny byte-tokenizer model (megarl.tasks.tiny_model) at path: TINY, with `spec`'s
    fields instead where given."""
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(path, TinyModelSpec(**{**TINY, **spec}))
    return path


def rl_files(root: Path, n_sft: int = 10, n_train: int = 64, n_eval: int = 8, **spec) -> Path:
    """The tiny model (`tiny_model`, with `spec`) at root/model and the arith task's files (seed 0)
    at root/task; returns root."""
    from megarl.tasks.arith import write_task_files

    tiny_model(root / "model", **spec)
    write_task_files(root / "task", n_sft=n_sft, n_train=n_train, n_eval=n_eval, seed=0)
    return root


def rl_overrides(root: Path, eval_set: bool = True) -> list[str]:
    """Config overrides naming root/model and root/task (its eval set, or none), then TINY_RL."""
    task = root / "task"
    return [f"model.hf_path={root / 'model'}", f"data.train_path={task / 'train.jsonl'}",
            f"data.eval=[{task / 'eval.jsonl'}]" if eval_set else "data.eval=[]", *TINY_RL]


def convert(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py with `args`, its output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(CONVERT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def convert_ok(*args, timeout: int = 300) -> str:
    """`convert` that must exit 0; its stdout."""
    r = convert(*args, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    return r.stdout


def last_value(stdout: str, name: str = "max_abs_logit_diff", line: int = -1) -> float:
    """The number of the `name=<number>` line of stdout (by default its last line)."""
    text = stdout.strip().splitlines()[line]
    assert text.startswith(name + "="), text
    return float(text.removeprefix(name + "="))


def convert_roundtrip(hf: Path, tmp: Path, to_megatron: list, to_hf: list, verify: list, timeout: int = 300) -> dict:
    """hf-to-megatron (flags `to_megatron`) into tmp/ckpt, megatron-to-hf (`to_hf`) into tmp/hf2,
    whose tensors must equal hf's bit for bit, and `verify` (flags) on tmp/hf2, whose logit diff
    must be < 1e-4. Returns each command's stdout by its name."""
    import torch
    from safetensors.torch import load_file

    out = {"hf-to-megatron": convert_ok("hf-to-megatron", "--hf", hf, "--out", tmp / "ckpt", *to_megatron,
                                        timeout=timeout),
           "megatron-to-hf": convert_ok("megatron-to-hf", "--ckpt", tmp / "ckpt", "--out", tmp / "hf2", *to_hf,
                                        timeout=timeout)}
    original, back = load_file(hf / "model.safetensors"), load_file(tmp / "hf2/model.safetensors")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    out["verify"] = convert_ok("verify", "--hf", tmp / "hf2", *verify, timeout=timeout)
    assert last_value(out["verify"]) < 1e-4
    return out


def logprob_gaps(trajectories: list[dict], appended: str) -> tuple[float, float]:
    """(largest |engine - trainer| log-prob over sampled tokens, largest |trainer log-prob| over the
    tokens the rollout appended, where trajectory[`appended`] is 1). The engine reports 0 on
    appended tokens (asserted); the second figure shows that the mask, not luck, keeps them out."""
    worst, appended_gap = 0.0, 0.0
    for t in trajectories:
        for extra, e, r in zip(t[appended], t["engine_logprobs"], t["trainer_logprobs"]):
            if extra:
                assert e == 0.0
                appended_gap = max(appended_gap, abs(r))
            else:
                worst = max(worst, abs(e - r))
    return worst, appended_gap
