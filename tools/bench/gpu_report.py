"""One table of a GPU session's results (tools/bench/gpu_session.sh), read from the files its steps
wrote: the steps' status, the smoke checks, TE-vs-local parity, the FP8 recipes, the quickstarts
(accuracy, log-prob mismatch, weight-sync time), the weight-sync benchmark and the training
benchmark rows.

    python -m tools.bench.gpu_report /tmp/gpu_session        # markdown, for docs/ and the session note
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.gpu_report`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import re
import sys
from pathlib import Path


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_rows(out: Path) -> list[str]:
    data = _json(out / "session.json")
    if not data:
        return []
    rows = [f"| step `{r['name']}` | {r['status']} | {r['seconds']} s (estimate {r['estimate']} s) |"
            for r in data["records"]]
    if data.get("next"):
        rows.append(f"| next call | `{data['next']}` | what did not run or failed |")
    return rows


def smoke_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("*smoke.json")):
        data = _json(path) or {"results": []}
        rows += [f"| smoke `{r['name']}` | {r['status']} | {r['detail'][:400]} |" for r in data["results"]]
    return rows or ["| smoke | not run | |"]


def parity_rows(out: Path) -> list[str]:
    data = _json(out / "parity.json")
    if not data:
        return []
    rows = []
    for r in data["rows"]:
        cands = r.get("candidates", {})
        detail = "; ".join(
            f"{impl} bf16 vs fp32: logits {c['logits']:.3g}, log-probs {c['logprobs']:.3g}, grads {c['grads']:.3g} "
            f"(worst {c['worst_grad']} {c['worst_grad_error']:.3g})" + (f", {c['backend']}" if c.get("backend") else "")
            for impl, c in cands.items())
        size = f"{r['sequences']} seqs / {r['tokens']} tokens" if "tokens" in r else ""
        rows.append(f"| parity {r['shape']} {size} | {r['status']} | {detail} ({data.get('bound', '')}) |")
    return rows


def fp8_rows(out: Path) -> list[str]:
    from tools.bench.fp8_train import summary

    data = _json(out / "fp8.json")
    if not data:
        return []
    return [f"| fp8 {data['shape']} `{r['recipe']}` {data['steps']} steps | {r['status'].split(':')[0]} | {summary(r)} |"
            for r in data["rows"]]


def _metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def rl_rows(out: Path) -> list[str]:
    rows = []
    for log in sorted(out.glob("rl_*.log")):
        name = log.stem
        last = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("quickstart:")]
        metrics = _metrics(out / f"{name}_metrics.jsonl")
        mm, mm_max = _mean(metrics, "rollout/logprob_mismatch"), _mean(metrics, "rollout/logprob_mismatch_max")
        sync = _mean(metrics, "time/weight_sync")
        extra = (f"rollout/logprob_mismatch mean {_fmt(mm, '.4f')} (max {_fmt(mm_max, '.3f')}), "
                 f"weight sync {_fmt(sync, '.3f')} s/step over {len(metrics)} logged steps")
        if not last:
            rows.append(f"| {name} | no result line | {extra}; {log.read_text(errors='replace')[-200:]!r} |")
            continue
        f = dict(re.findall(r"(\w+)=(\S+)", last[-1]))
        rows.append(f"| {name} (1 GPU, quickstart) | greedy {f.get('accuracy_before')} -> {f.get('accuracy_after')} | "
                    f"{extra}; wall {f.get('wall_s')} s |")
    legacy = out / "quickstart.log"  # the 2026-11 sessions' name
    if legacy.exists():
        last = [line for line in legacy.read_text().splitlines() if line.startswith("quickstart:")]
        if not last:
            return rows + [f"| quickstart | no result line | {legacy.read_text()[-300:]!r} |"]
        f = dict(re.findall(r"(\w+)=(\S+)", last[-1]))
        rows.append(f"| quickstart (1 GPU, 10 RL steps) | after SFT {f.get('accuracy_before')}, after RL "
                    f"{f.get('accuracy_after')} | wall {f.get('wall_s')} s |")
    return rows


def sync_rows(out: Path) -> list[str]:
    data = _json(out / "weight_sync.json")
    if not data:
        return []
    rows = []
    for r in data["rows"]:
        if r.get("status") != "ok":
            rows.append(f"| weight sync {r['shape']} ({r.get('engine')}) | {r.get('status')} | |")
            continue
        rows.append(f"| weight sync {r['shape']} ({r['engine']}, {r['weights_gb']:.2f} GB bf16) | "
                    f"{r['update_s']:.3f} s ({r['gb_per_s']:.1f} GB/s) | median of {len(r['update_all_s'])}, first "
                    f"{r['first_update_s']:.2f} s; release {r['release_s']:.3f} s, resume {r['resume_s']:.3f} s; engine "
                    f"start {r['start_s']:.1f} s; greedy identical after re-sync: {r['greedy_same']} |")
    return rows


def bench_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("bench_*.json")):
        data = _json(path) or {"rows": []}
        for r in data["rows"]:
            what = (f"bench {r['shape']} {r['impl']}/{r['attn']} {r.get('precision', 'bf16')} {r['seq']} tok x "
                    f"{r['microbatches']} mb")
            if r["status"] != "ok":
                rows.append(f"| {what} | {r['status'][:120]} | |")
                continue
            rows.append(f"| {what} | MFU {_fmt(r['mfu'], '.1%')} | step {r['step_s']:.3f} s, "
                        f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.0f} TFLOP/s, log-prob MFU "
                        f"{_fmt(r['logprob_mfu'], '.1%')}, peak {_fmt(r['peak_mem_gib'], '.1f')} GiB |")
    return rows or ["| bench | not run | |"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="gpu_out", help="the session's output folder (default gpu_out)")
    out = Path(p.parse_args(argv).out)
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else "unknown device"
    versions = (out / "versions.txt").read_text().strip() if (out / "versions.txt").exists() else ""
    print(f"GPU session: {device}" + (f"\n{versions}" if versions else "") + "\n")
    print("| what | result | detail |\n| --- | --- | --- |")
    for line in (step_rows(out) + smoke_rows(out) + parity_rows(out) + fp8_rows(out) + rl_rows(out) + sync_rows(out)
                 + bench_rows(out)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
