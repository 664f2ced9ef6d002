"""Quickstart task `tool_mul`: products of two 3-digit numbers, where one interpreter call answers
what the tiny model's chain of thought rarely gets right (the tool quickstart, docs/tools.md).

Prompt (template ``arith``): ``"Q: 347*851=?\\n"``. Two kinds of reference response:

    tool trace (ReTool's code format)       chain of thought (long multiplication)
    <code>                                  347*1=347
    print(347*851)                          347*50=17350
    </code>                                 347*800=277600
    <interpreter>                           347+17350=17697
    295297                                  17697+277600=295297
    </interpreter>                          Answer: 295297
    Answer: 295297

The SFT set holds `tool_share` tool traces (the rest chains of thought, on other problems), so
the SFT model starts mostly without the tool: greedy, it writes the chain of thought, whose
partial products and sums a 3-layer model gets right rarely; sampled, it calls the
interpreter in about `tool_share` of its answers and is then nearly always right. In the SFT
traces the interpreter's output is part of the response text; in RL rollouts it is the real
tool's observation (no loss). Rows: ``id, problem, answer, data_source="tool_mul"``; the math
verifier scores ``Answer: <n>``.
"""

from __future__ import annotations

import random
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.data.templates import apply_template
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask, write_disjoint_splits

DATA_SOURCE = "tool_mul"
TOOL_SHARE = 0.25
TABLE_METRICS = tuple(f"eval/{DATA_SOURCE}/tools/{k}" for k in ("call_rate", "accuracy_with_call",
                                                                  "accuracy_without_call"))


def problem_text(a: int, b: int) -> str:
    return f"{a}*{b}"


def tool_response(a: int, b: int) -> str:
    """The ReTool-format trace: one code block, the interpreter's output, the answer."""
    return f"<code>\nprint({a}*{b})\n</code>\n<interpreter>\n{a * b}\n</interpreter>\nAnswer: {a * b}"


def cot_response(a: int, b: int) -> str:
    """Long multiplication: a times each digit of b (with its place value), then the running sum."""
    lines, partial = [], []
    for k, d in enumerate(reversed(str(b))):
        p = a * int(d) * 10**k
        lines.append(f"{a}*{int(d) * 10**k}={p}")
        partial.append(p)
    total = partial[0]
    for p in partial[1:]:
        lines.append(f"{total}+{p}={total + p}")
        total += p
    return "\n".join(lines + [f"Answer: {total}"])


def write_task_files(out_dir: str | Path, n_sft: int, n_train: int, n_eval: int, seed: int,
                     tool_share: float = TOOL_SHARE) -> dict[str, Path]:
    """``sft.jsonl`` (prompt, response: a tool trace with probability `tool_share`, else the chain of
    thought), ``train.jsonl`` and ``eval.jsonl`` (problem rows); pairwise-disjoint problems."""
    rng = random.Random(seed)

    def draw():
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return (a, b), (a, b)

    def make_row(split, i, problem):
        a, b = problem
        row = {"id": f"{DATA_SOURCE}-{split}-{i}", "problem": problem_text(a, b), "answer": str(a * b)}
        if split == "sft":
            use_tool = rng.random() < tool_share
            return row | {"prompt": apply_template("arith", problem_text(a, b)),
                          "response": tool_response(a, b) if use_tool else cot_response(a, b)}
        return row | {"data_source": DATA_SOURCE}

    return write_disjoint_splits(out_dir, {"eval": n_eval, "train": n_train, "sft": n_sft}, draw, make_row)


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    write_task_files(out_dir, n_sft=8000, n_train=4000, n_eval=200, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register(DATA_SOURCE)(QuickstartTask(
    write_files=write_quickstart_files, table_metrics=TABLE_METRICS, comparison=("no_tools", ("rollout.tools.enable=false",))))
