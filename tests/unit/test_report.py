"""megarl report: the panels read the run's metrics.jsonl; only panels with data are drawn, in a grid
without holes; PNG and self-contained HTML are written."""

import json

import pytest
from PIL import Image

from megarl.report import PANELS, grid, main, matched, read_metrics, write_report


def write_run(run, rows, extra_lines=()):
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


ROWS = [{"step": 0, "eval/arith/accuracy": 0.1, "eval/accuracy": 0.1},
        *({"step": s, "reward/mean": -1 + 0.2 * s, "reward/accuracy": 0.1 * s, "actor/entropy": 2.0 - 0.1 * s,
           "actor/approx_kl": 0.01 * s, "actor/grad_norm": 1.0, "response_length/mean": 50.0 + s,
           "response_length/clip_ratio": 0.1, "time/rollout": 1.0, "time/actor_update": 0.5, "time/step": 1.6,
           "perf/tokens_per_s": 1000.0 + s, "critic/explained_variance": None} for s in (1, 2, 3)),
        {"step": 3, "eval/arith/accuracy": 0.4, "eval/accuracy": 0.4},
        {"step": 3, "reward/mean": -0.123}]  # a step logged again (after a resume) keeps the last value


def test_series_keep_the_last_value_of_a_step_and_skip_cut_lines(tmp_path):
    write_run(tmp_path, ROWS, ['{"step": 4, "reward/me'])
    series, bad = read_metrics(tmp_path / "metrics.jsonl")
    assert bad == 1
    assert series["reward/mean"] == [(1, -0.8), (2, pytest.approx(-0.6)), (3, -0.123)]
    assert "critic/explained_variance" not in series  # null values are not points
    eval_panel = next(p for p in PANELS if p.title == "Eval accuracy")
    assert matched(eval_panel, series) == ["eval/accuracy", "eval/arith/accuracy"]


def test_png_and_html_are_written_and_name_the_metrics(tmp_path, capsys):
    write_run(tmp_path / "run", ROWS)
    assert main([str(tmp_path / "run")]) == 0
    png, page = tmp_path / "run" / "report.png", tmp_path / "run" / "report.html"
    assert capsys.readouterr().out.strip() == f"report: png={png} html={page}"
    with Image.open(png) as im:
        assert im.size == (1600, 1200)
        colours = len(im.convert("RGB").resize((400, 300)).getcolors(maxcolors=1 << 20))
    assert colours > 50  # curves, not a blank canvas
    text = page.read_text()
    assert "data:image/png;base64," in text and "<td>reward/mean</td><td>-0.8</td><td>-0.123</td>" in text
    assert "<td>time/rollout</td>" in text and "critic/explained_variance" not in text
    assert "<p>Not logged in this run (no panel): Critic explained variance.</p>" in text


def test_a_dir_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds no metrics"):
        write_run(tmp_path / "empty", [], ["garbage"])
        write_report(tmp_path / "empty")


def test_each_panel_plots_the_run_s_curves(tmp_path):
    from megarl.report import draw

    write_run(tmp_path, ROWS)
    series, _ = read_metrics(tmp_path / "metrics.jsonl")
    fig = draw(series, "t")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels) == [p.title for p in PANELS if p.title != "Critic explained variance"]  # no critic logged

    def curves(title):
        ax = panels[title]
        return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}

    assert curves("Reward / accuracy (training samples)") == {"mean": [-0.8, pytest.approx(-0.6), -0.123],
                                                             "accuracy": [0.1, 0.2, pytest.approx(0.3)]}
    assert curves("Eval accuracy") == {"arith/accuracy": [0.1, 0.4]}  # one set: no separate mean curve
    assert curves("Entropy")["entropy"] == [1.9, 1.8, pytest.approx(1.7)]
    assert curves("Throughput")["tokens_per_s"] == [1001.0, 1002.0, 1003.0]
    assert curves("Time per phase")["step (total)"] == [1.6, 1.6, 1.6]
    assert len(panels["Time per phase"].collections) == 2  # rollout and actor_update stacked
    clip = [a for a in fig.axes if a.get_ylabel() == "clip_ratio"]
    assert [list(line.get_ydata()) for line in clip[0].get_lines()] == [[0.1, 0.1, 0.1]]
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]  # no placeholder panel


def rows_of_panels(fig) -> dict[int, list[tuple[int, int]]]:
    """{grid row: [(first column, last column + 1), ...] of its panels, left to right}."""
    rows = {}
    for ax in fig.axes:
        if ax.get_title():  # twin axes (the right y axis) share their panel's cell
            spec = ax.get_subplotspec()
            rows.setdefault(spec.rowspan.start, []).append((spec.colspan.start, spec.colspan.stop))
    return {r: sorted(cells) for r, cells in sorted(rows.items())}


@pytest.mark.parametrize("drop, widths", [
    ([], [[1, 1, 1]] * 3),  # all 9 panels: 3 x 3
    (["critic/explained_variance"], [[2, 2, 2], [2, 2, 2], [3, 3]]),  # the DAPO quickstart's 8: the last row halves
    (["critic/explained_variance", "perf/tokens_per_s"], [[1, 1, 1], [1, 1, 1], [3]]),  # 7: the last panel is wide
    (["critic/explained_variance", "perf/tokens_per_s", "time/*", "actor/grad_norm", "actor/approx_kl"],
     [[1, 1], [1, 1]]),  # 4: 2 x 2
])
def test_the_panels_with_data_fill_the_grid_without_holes(tmp_path, drop, widths):
    from megarl.report import draw

    rows = [dict(r) for r in ROWS]
    for r in rows:
        if "critic/explained_variance" in r:
            r["critic/explained_variance"] = 0.5
        for key in [k for k in r for d in drop if k == d or (d.endswith("*") and k.startswith(d[:-1]))]:
            del r[key]
    write_run(tmp_path, rows)
    series, _ = read_metrics(tmp_path / "metrics.jsonl")
    fig = draw(series, "t")
    got = rows_of_panels(fig)
    assert [[b - a for a, b in cells] for cells in got.values()] == widths
    full = sum(widths[0])  # the grid's width in columns
    for cells in got.values():  # each row: panels side by side from the left edge to the right one
        assert cells[0][0] == 0 and cells[-1][1] == full and all(a[1] == b[0] for a, b in zip(cells, cells[1:]))
    assert fig.get_size_inches()[1] == 4 * len(widths)
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]


def test_grid_shapes():
    assert grid(1) == (1, [(0, 0, 1)])
    assert grid(4) == (2, [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)])
    assert grid(5) == (6, [(0, 0, 2), (0, 2, 2), (0, 4, 2), (1, 0, 3), (1, 3, 3)])
    assert grid(8) == (6, [(0, 0, 2), (0, 2, 2), (0, 4, 2), (1, 0, 2), (1, 2, 2), (1, 4, 2), (2, 0, 3), (2, 3, 3)])


def test_a_run_without_any_drawn_metric_is_a_clear_error(tmp_path):
    write_run(tmp_path, [{"step": 1, "sft/nll": 2.0}])
    with pytest.raises(ValueError, match="none of the metrics the report draws"):
        write_report(tmp_path)
