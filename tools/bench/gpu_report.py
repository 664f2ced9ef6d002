"""One table of a GPU session's results (tools/bench/gpu_session.sh): the smoke checks, the training
benchmark rows (MFU per shape, tokens per micro-batch and attention kernel) and the quickstart's
accuracies, read from the JSON / logs the session wrote.

    python -m tools.bench.gpu_report gpu_out            # markdown, for docs/ and the session note
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


def smoke_rows(out: Path) -> list[str]:
    path = out / "smoke.json"
    if not path.exists():
        return ["| smoke | not run | |"]
    data = json.loads(path.read_text())
    return [f"| smoke `{r['name']}` | {r['status']} | {r['detail'][:400]} |" for r in data["results"]]


def bench_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("bench_*.json")):
        data = json.loads(path.read_text())
        for r in data["rows"]:
            what = f"bench {r['shape']} {r['impl']}/{r['attn']} {r['seq']} tok x {r['microbatches']} mb"
            if r["status"] != "ok":
                rows.append(f"| {what} | {r['status'][:120]} | |")
                continue
            rows.append(f"| {what} | MFU {_fmt(r['mfu'], '.1%')} | step {r['step_s']:.3f} s, "
                        f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.0f} TFLOP/s, log-prob MFU "
                        f"{_fmt(r['logprob_mfu'], '.1%')}, peak {_fmt(r['peak_mem_gib'], '.1f')} GiB |")
    return rows or ["| bench | not run | |"]


def quickstart_rows(out: Path) -> list[str]:
    log = out / "quickstart.log"
    if not log.exists():
        return ["| quickstart | not run | |"]
    last = [line for line in log.read_text().splitlines() if line.startswith("quickstart:")]
    if not last:
        return [f"| quickstart | no result line | {log.read_text()[-300:]!r} |"]
    fields = dict(re.findall(r"(\w+)=(\S+)", last[-1]))
    return [f"| quickstart (1 GPU, 10 RL steps) | after SFT {fields.get('accuracy_before')}, after RL "
            f"{fields.get('accuracy_after')} | wall {fields.get('wall_s')} s |"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="gpu_out", help="the session's output folder (default gpu_out)")
    out = Path(p.parse_args(argv).out)
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else "unknown device"
    print(f"GPU session: {device}\n")
    print("| what | result | detail |\n| --- | --- | --- |")
    for line in smoke_rows(out) + bench_rows(out) + quickstart_rows(out):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
