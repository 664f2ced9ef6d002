"""The quickstart (2 RL steps, 2 gloo ranks) with every logger on: W&B offline and an MLflow file
store hold the config and the per-step metrics and a resumed quickstart continues both runs;
`megarl report` wrote the curves the quickstart points at; `megarl eval` on the final model
(exported to HF, and as the megarl checkpoint) prints the accuracy of the quickstart's own final
eval. Tests run in file order: the last one resumes the run to step 3."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.readback import mlflow_runs, wandb_runs

REPO = Path(__file__).resolve().parents[2]
LAST = re.compile(r"^quickstart: accuracy_before=(\S+) accuracy_after=(\S+) wall_s=(\S+) run_dir=(\S+)$")
SFT_STEPS = 165  # the quickstart's own: a greedy accuracy above 0 (90 gave 0.0 on one 2-core machine), so that equal accuracies mean something
COMMON = [f"sft.max_steps={SFT_STEPS}", "trainer.eval_interval=1", "algorithm.dynamic_sampling=false",
          "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", "algorithm.mini_batch_size=16",
          "trainer.loggers=[tensorboard, jsonl, wandb, mlflow]", "trainer.wandb_mode=offline", "trainer.tags=[ci]"]
ENV = {k: v for k, v in os.environ.items() if k != "WANDB_DIR"}  # W&B's files in the run dir, where the test reads them
ENV.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def megarl(*args, timeout=900) -> str:
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def qs(tmp_path_factory):
    run = tmp_path_factory.mktemp("eco") / "qs"
    out = megarl("quickstart", f"trainer.run_dir={run}", "trainer.total_steps=2", *COMMON)
    lines = out.strip().splitlines()
    return {"run": run, "lines": lines, "last": LAST.match(lines[-1])}


def test_quickstart_points_at_its_report(qs):
    run = qs["run"]
    assert qs["last"], qs["lines"][-1]
    assert f"report: png={run / 'report.png'} html={run / 'report.html'}" in qs["lines"][-3:]  # above the last line
    from PIL import Image

    with Image.open(run / "report.png") as im:
        assert im.size == (1600, 1200)
    page = (run / "report.html").read_text()
    assert "data:image/png;base64," in page and "<td>reward/mean</td>" in page and "<td>actor/entropy</td>" in page


def test_wandb_and_mlflow_hold_the_config_and_every_step(qs):
    run, logged = qs["run"], rows(qs["run"])
    train = {r["step"]: r for r in logged if "actor/pg_loss" in r}
    (wb,) = [r for r in wandb_runs(run) if r["summary"]["name"] == "qs"]
    assert wb["summary"]["config"]["trainer"]["total_steps"] == 2 and wb["summary"]["tags"] == ["ci"]
    assert sorted(wb["history"]) == [0, 1, 2]  # the step-0 eval, then two RL steps (with their evals)
    for step in (1, 2):
        assert wb["history"][step]["reward/mean"] == pytest.approx(train[step]["reward/mean"])
        assert wb["history"][step]["eval/accuracy"] == pytest.approx(qs_eval(logged, step))
    runs = {r["name"]: r for r in mlflow_runs((run / "mlruns").as_uri(), "megarl")}
    assert set(runs) == {"qs", "qs-sft"}  # the SFT warm start logs a run of its own to the same store
    ml = runs["qs"]
    assert ml["params"]["trainer.total_steps"] == "2" and ml["params"]["algorithm.name"] == "dapo"
    assert [s for s, _ in ml["history"]["reward/mean"]] == [1, 2]
    assert [v for _, v in ml["history"]["reward/mean"]] == pytest.approx([train[s]["reward/mean"] for s in (1, 2)])
    assert [s for s, _ in ml["history"]["eval/accuracy"]] == [0, 1, 2]
    assert len(runs["qs-sft"]["history"]["sft/nll"]) == SFT_STEPS


def qs_eval(logged: list[dict], step: int, key: str = "eval/accuracy") -> float:
    return [r[key] for r in logged if r["step"] == step and key in r][-1]


def eval_line(out: str) -> float:
    m = re.match(r"^eval: accuracy=(\S+) samples=(\S+)$", out.strip().splitlines()[-1])
    assert m, out[-2000:]
    return float(m[1])


def test_megarl_eval_prints_the_quickstart_final_accuracy(qs, tmp_path):
    run = qs["run"]
    after = float(qs["last"][2])
    logged = rows(run)
    assert after == pytest.approx(qs_eval(logged, 2), abs=1e-4) and after > 0
    ckpt = run / "checkpoints" / "step_2" / "actor"
    megarl("convert", "megatron-to-hf", "--ckpt", ckpt, "--out", tmp_path / "hf")
    for how, model in (("hf", ["--hf", tmp_path / "hf"]), ("ckpt", ["--ckpt", ckpt])):
        out = megarl("eval", "--nproc", 2, *model, "--data", run / "task" / "eval.jsonl", "--config", run / "config.yaml",
                     "--out", tmp_path / how)
        assert "avg@n" in out and "maj@n" in out  # the table
        assert eval_line(out) == pytest.approx(after, abs=1e-4), how
        (summary,) = json.loads((tmp_path / how / "summary.json").read_text()).values()
        assert summary["response_length"] == pytest.approx(qs_eval(logged, 2, "eval/arith/response_length")), how
        assert summary["score"] == pytest.approx(qs_eval(logged, 2, "eval/arith/score")), how
        samples = [json.loads(x) for x in (tmp_path / how / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == summary["prompts"] == 200
        assert sum(s["acc"] for s in samples) / len(samples) == pytest.approx(after, abs=1e-4)


def test_a_resumed_quickstart_continues_the_same_wandb_and_mlflow_runs(qs):
    run = qs["run"]
    ids = json.loads((run / "loggers.json").read_text())
    megarl("quickstart", f"trainer.run_dir={run}", "trainer.total_steps=3", "trainer.resume=true", *COMMON)
    assert json.loads((run / "loggers.json").read_text()) == ids
    first, resumed = [r for r in wandb_runs(run) if r["summary"]["name"] == "qs"]
    assert first["summary"]["run_id"] == resumed["summary"]["run_id"] == ids["wandb"]
    assert sorted(resumed["history"]) == [3]
    runs = [r for r in mlflow_runs((run / "mlruns").as_uri(), "megarl") if r["name"] == "qs"]
    assert [r["id"] for r in runs] == [ids["mlflow"]["run_id"]]
    assert [s for s, _ in runs[0]["history"]["reward/mean"]] == [1, 2, 3]
