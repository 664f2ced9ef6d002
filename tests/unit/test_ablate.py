"""tools/research/ablate.py's aggregation on fabricated run dirs (no quickstart is run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
from tools.research import ablate  # noqa: E402


def fake_run(path: Path, evals: dict[int, float], wall: float | None, torn_line: bool = False,
             steps: list[dict] = ()) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": 1, "reward/accuracy": 0.1}, *steps]
    rows += [{"step": s, "eval/accuracy": v} for s, v in evals.items()]
    text = "\n".join(json.dumps(r) for r in rows) + ("\n{\"step\": 4" if torn_line else "")
    (path / "metrics.jsonl").write_text(text)
    if wall is not None:
        (path / ablate.WALL_FILE).write_text(json.dumps({"wall_s": wall}))
    return path


def test_summary_final_is_the_last_step_and_best_excludes_step_zero(tmp_path):
    run = fake_run(tmp_path / "r", {0: 0.9, 10: 0.5, 30: 0.8, 20: 0.7, 40: 0.6}, 120.0, torn_line=True)
    assert ablate.summarize_run(run) == {"final": 0.6, "best": 0.8, "wall_s": 120.0, "step_s": None,
                                         "ev_pretrain": None, "ev_policy": None}


def test_summary_critic_and_step_time_columns(tmp_path):
    steps = [{"step": 1, "critic/pretraining": 1.0, "critic/explained_variance": -0.2, "time/step": 2.0},
             {"step": 2, "critic/pretraining": 1.0, "critic/explained_variance": 0.1, "time/step": 2.5},
             {"step": 3, "critic/pretraining": 0.0, "critic/explained_variance": 0.3, "time/step": 4.0},
             {"step": 4, "critic/explained_variance": 0.5, "time/step": 3.5}]
    s = ablate.summarize_run(fake_run(tmp_path / "r", {0: 0.2, 4: 0.7}, 60.0, steps=steps))
    assert s["step_s"] == pytest.approx(12.0) and s["ev_pretrain"] == pytest.approx(0.1)
    assert s["ev_policy"] == pytest.approx(0.4)  # steps 3 and 4: the policy steps


def test_unfinished_runs_have_no_summary(tmp_path):
    assert ablate.summarize_run(fake_run(tmp_path / "no_wall", {0: 0.2, 40: 0.8}, None)) is None
    assert ablate.summarize_run(fake_run(tmp_path / "only_before", {0: 0.2}, 50.0)) is None
    assert ablate.summarize_run(tmp_path / "missing") is None


def test_mean_and_sample_std():
    assert ablate.mean_std([0.5]) == (0.5, 0.0)
    m, s = ablate.mean_std([0.6, 0.8, 1.0])
    assert m == pytest.approx(0.8) and s == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)


def test_table_rows_over_seeds(tmp_path):
    runs = {"VAPO": [{**ablate.summarize_run(fake_run(tmp_path / f"v{i}", {0: 0.2, 40: f}, w)), "seed": i + 1}
                     for i, (f, w) in enumerate([(0.8, 100.0), (0.9, 140.0)])],
            "w/o clip-higher": [], }
    rows = ablate.aggregate(runs)
    assert [r["variant"] for r in rows] == ["VAPO"]  # a variant without finished runs is left out
    r = rows[0]
    assert r["n"] == 2 and r["final"][0] == pytest.approx(0.85) and r["final"][1] == pytest.approx(math.sqrt(0.005))
    assert r["wall_s"] == (pytest.approx(120.0), pytest.approx(math.sqrt(800.0)))
    table = ablate.format_table(rows)
    assert "| VAPO | 2 (1,2) | 0.850 ± 0.071 | 0.850 ± 0.071 | - | - | - | 120 ± 28 |" in table.splitlines()


def test_dry_run_prints_one_seeded_command_per_variant_and_seed(tmp_path, capsys):
    ablate.main(["--method", "ppo", "--seeds", "0", "1", "--root", str(tmp_path), "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert all(" quickstart --config configs/quickstart/" in x for x in lines)
    assert lines[0].endswith(f"trainer.run_dir={tmp_path}/ppo/ppo/seed0 trainer.seed=0")
    assert "vc_ppo.yaml" in lines[3] and lines[3].endswith("trainer.seed=1")
    assert not any(tmp_path.iterdir())  # nothing was created


def test_every_variant_override_is_a_valid_config():
    from megarl.config import load_config

    for method, variants in ablate.METHODS.items():
        for v in variants:
            load_config(str(REPO / v.config), list(v.overrides))  # raises ConfigError naming the field
