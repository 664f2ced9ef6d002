"""`megarl report RUN_DIR [--out DIR]`: the curves of a run, as a PNG and a self-contained HTML page.

Reads RUN_DIR/metrics.jsonl (written by the jsonl logger; a step logged twice, e.g. again after a
resume, keeps its last value; a line a kill cut short is skipped) and draws one panel per question
people ask of an RL run:

    reward and accuracy of the training samples     eval accuracy per set
    response length (mean, p90, max) and clip ratio policy entropy
    KL to the rollout / reference policy            gradient norms (actor, critic)
    critic explained variance                       wall time per phase (stacked) and per step
    throughput (tokens/s)

Only the panels with data are drawn, filling a grid without holes (3 across; a last row of fewer
panels shares the width); the HTML page names the panels the run logged nothing for. The page
embeds the PNG (base64) and a table of each plotted metric's first, last, min and max, so it can be
mailed or attached as one file. Writes <out>/report.png and <out>/report.html (default out:
RUN_DIR) and prints both paths.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

Series = dict[str, list[tuple[int, float]]]


@dataclass
class Panel:
    title: str
    keys: list[str]  # exact keys, or prefixes ending in "*"
    ylabel: str = ""
    right: tuple[str, ...] = ()  # keys on a second y axis
    stacked: bool = False  # time per phase: stacked areas of the matched keys, the rest as lines
    markers: bool = False  # sparse series (evals)


PANELS = [
    Panel("Reward / accuracy (training samples)", ["reward/mean", "reward/accuracy"]),
    Panel("Eval accuracy", ["eval/*accuracy"], markers=True),
    Panel("Response length and clip ratio", ["response_length/mean", "response_length/p90", "response_length/max"],
          "tokens", right=("response_length/clip_ratio",)),
    Panel("Entropy", ["actor/entropy"], "nats / token"),
    Panel("KL", ["actor/approx_kl", "actor/kl_loss", "actor/reward_kl", "rollout/logprob_mismatch"]),
    Panel("Grad norm", ["actor/grad_norm", "critic/grad_norm"]),
    Panel("Critic explained variance", ["critic/explained_variance"]),
    Panel("Time per phase", ["time/*"], "s", stacked=True),
    Panel("Throughput", ["perf/tokens_per_s"], "tokens / s"),
]


def read_metrics(path: Path) -> tuple[Series, int]:
    """{key: [(step, value), ...] sorted by step} of a metrics.jsonl, and how many lines were unreadable."""
    by_key: dict[str, dict[int, float]] = {}
    bad = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += 1
            continue
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                by_key.setdefault(k, {})[step] = float(v)
    return {k: sorted(d.items()) for k, d in by_key.items()}, bad


def matched(panel: Panel, series: Series) -> list[str]:
    out = []
    for key in panel.keys:
        if key.endswith("*") or "*" in key:
            head, _, tail = key.partition("*")
            out += sorted(k for k in series if k.startswith(head) and k.endswith(tail) and k not in out)
        elif key in series:
            out.append(key)
    return out


def has_data(panel: Panel, series: Series) -> bool:
    return bool(matched(panel, series)) or any(k in series for k in panel.right)


def grid(n: int) -> tuple[int, list[tuple[int, int, int]]]:
    """A grid without holes for n panels: (columns of the grid, [(row, first column, columns spanned)]
    per panel). Rows hold 3 panels (2 for n = 4, n for n < 3); the last row's panels share the
    whole width, which the grid's lcm(row width, last row's count) columns divide evenly."""
    import math

    across = 2 if n == 4 else min(n, 3)
    rows = -(-n // across)
    last = n - (rows - 1) * across
    cols = math.lcm(across, last)
    cells = []
    for i in range(n):
        row, pos = divmod(i, across)
        width = cols // (last if row == rows - 1 else across)
        cells.append((row, pos * width, width))
    return cols, cells


def draw(series: Series, title: str):  # noqa: C901 - one loop over the panels
    """The report figure (matplotlib Figure, no pyplot state): the panels with data, 4 inches a row."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in PANELS if has_data(p, series)]
    if not panels:
        raise ValueError("none of the report's metrics was logged")
    cols, cells = grid(len(panels))
    rows = cells[-1][0] + 1
    fig = Figure(figsize=(16, 4 * rows), dpi=100, layout="constrained")
    fig.suptitle(title, fontsize=13)
    spec = fig.add_gridspec(rows, cols)
    for (row, col, width), panel in zip(cells, panels):
        ax = fig.add_subplot(spec[row, col:col + width])
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("step")
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        keys = matched(panel, series)
        if len(keys) == 2 and "eval/accuracy" in keys:  # one eval set: the mean over sets is that set's curve
            keys.remove("eval/accuracy")
        right = [k for k in panel.right if k in series]
        label = _labeller(keys + right)
        if panel.stacked:
            _stacked_times(ax, series, keys)
        else:
            for k in keys:
                xs, ys = zip(*series[k])
                ax.plot(xs, ys, marker="o" if panel.markers or len(xs) < 3 else None, ms=4, label=label(k))
        handles, labels = ax.get_legend_handles_labels()
        if right:
            twin = ax.twinx()
            for k in right:
                xs, ys = zip(*series[k])
                twin.plot(xs, ys, color="tab:red", ls="--", marker="o" if len(xs) < 3 else None, ms=4,
                          label=f"{label(k)} (right)")
            twin.set_ylabel(", ".join(label(k) for k in right), color="tab:red")
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(handles, labels, loc="best", fontsize=8)
    return fig


def _labeller(keys: list[str]):
    """Legend labels: the keys without the first path segment they all share (response_length/...)."""
    heads = {k.split("/", 1)[0] for k in keys}
    if len(heads) == 1 and all("/" in k for k in keys):
        return lambda k: k.split("/", 1)[1]
    return lambda k: k


def _stacked_times(ax, series: Series, keys: list[str]) -> None:
    """Phases (time/* but time/step) stacked over the steps where all were logged; time/step as a line."""
    phases = [k for k in keys if k != "time/step"]
    if phases:
        steps = sorted(set.intersection(*(set(s for s, _ in series[k]) for k in phases)))
        if steps:
            values = [[dict(series[k])[s] for s in steps] for k in phases]
            ax.stackplot(steps, values, labels=[k.removeprefix("time/") for k in phases], alpha=0.8)
    if "time/step" in keys:
        xs, ys = zip(*series["time/step"])
        ax.plot(xs, ys, color="black", lw=1.5, marker="o" if len(xs) < 3 else None, ms=4, label="step (total)")


def summary_rows(series: Series) -> list[tuple[str, str, str, str, str, int]]:
    keys = []
    for panel in PANELS:
        keys += [k for k in matched(panel, series) + list(panel.right) if k in series and k not in keys]
    rows = []
    for k in keys:
        ys = [v for _, v in series[k]]
        rows.append((k, f"{ys[0]:.4g}", f"{ys[-1]:.4g}", f"{min(ys):.4g}", f"{max(ys):.4g}", len(ys)))
    return rows


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Path]:
    """Writes report.png and report.html for `run_dir` into `out` (default run_dir); returns both paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"megarl report: {metrics} not found (is {run} a run dir with the jsonl logger on?)")
    series, bad = read_metrics(metrics)
    if not series:
        raise ValueError(f"megarl report: {metrics} holds no metrics" + (f" ({bad} unreadable lines)" if bad else ""))
    if not any(has_data(p, series) for p in PANELS):
        keys = ", ".join(k for p in PANELS for k in p.keys + list(p.right))
        raise ValueError(f"megarl report: {metrics} holds none of the metrics the report draws ({keys})")
    title = f"{run.resolve().name}: {_describe(run)}"
    fig = draw(series, title)
    out_dir = Path(out) if out is not None else run
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / "report.png", out_dir / "report.html"
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png")
    png.write_bytes(buf.getvalue())
    missing = [p.title for p in PANELS if not has_data(p, series)]
    page.write_text(_html(title, buf.getvalue(), summary_rows(series), bad, missing), encoding="utf-8")
    return png, page


def _describe(run: Path) -> str:
    """The algorithm and step count from run/config.yaml, when it is there."""
    try:
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text())
        return f"{cfg['algorithm']['name']}, {cfg['trainer']['total_steps']} steps"
    except (OSError, KeyError, TypeError, ValueError):
        return "metrics.jsonl"


def _html(title: str, png: bytes, rows, bad: int, missing: list[str]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>\n" for r in rows)
    note = f"<p>{bad} unreadable line(s) of metrics.jsonl skipped.</p>" if bad else ""
    if missing:
        note += f"<p>Not logged in this run (no panel): {html.escape(', '.join(missing))}.</p>"
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>"
            f"</head><body><h1>{html.escape(title)}</h1>\n"
            f"<img alt='curves' style='max-width:100%' src='data:image/png;base64,{base64.b64encode(png).decode()}'>\n"
            f"{note}<h2>Plotted metrics</h2><table><tr><th>metric</th><th>first</th><th>last</th><th>min</th>"
            f"<th>max</th><th>points</th></tr>\n{cells}</table></body></html>\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megarl report", description="a run's curves as PNG + HTML")
    p.add_argument("run_dir", help="the run dir (its metrics.jsonl)")
    p.add_argument("--out", help="where to write report.png / report.html (default: the run dir)")
    a = p.parse_args(argv)
    try:
        png, page = write_report(a.run_dir, a.out)
    except (FileNotFoundError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"report: png={png} html={page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
