"""Quickstart task: multi-digit addition with a digit-by-digit chain of thought.

Problem text ``"347+85"``; prompt (template ``arith``) ``"Q: 347+85=?\\n"``; reference response::

    7+5+0=12 2
    4+8+1=13 32
    3+0+1=4 432
    Answer: 432

One line per column from the right: ``<digit of a>+<digit of b>+<carry in>=<column sum>`` and
then the answer so far: the column's last digit written in front of the previous line's answer
(the last column writes its whole sum). A missing digit is written 0; the carry into the next
column is the tens digit of the column sum. The last line is DAPO-style ``Answer: <n>`` so the
math verifier scores it. Every step is local (the answer grows by one digit per line and the
final line copies it), so a tiny model learns the procedure quickly.

Operand sampling: both operands have exactly ``digits`` digits, uniform among such numbers
(0..9 for one digit). Fixed-width operands matter for RL: with mixed widths (1..3 digits) the
tiny model's early errors are mostly misread digit positions, which GRPO barely moves (plain
single-process GRPO, tools/research/probe_arith_grpo.py: 0.21 -> ~0.40 greedy in 100 steps); with fixed
width the same loop goes 0.255 -> 0.605 in 30 steps.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask

from megarl.data.templates import apply_template

DATA_SOURCE = "arith"
ANSWER_RE = re.compile(r"^Answer: (-?\d+)$")


def sample_operand(rng: random.Random, digits: int) -> int:
    """A uniform number with exactly `digits` digits (0..9 for one digit)."""
    return rng.randint(0, 9) if digits == 1 else rng.randint(10 ** (digits - 1), 10**digits - 1)


def problem_text(a: int, b: int) -> str:
    return f"{a}+{b}"


def cot_lines(a: int, b: int, wrong_column: int | None = None, delta: int = 1) -> tuple[list[str], int]:
    """The chain-of-thought lines of a + b (non-negative ints; no Answer line) and the result they
    reach; with `wrong_column` that column's sum is off by `delta` (a wrong step that the later
    columns follow consistently, so the result is a + b + delta * 10^column)."""
    if a < 0 or b < 0:
        raise ValueError(f"arith: operands must be non-negative, got {a}, {b}")
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry, so_far = [], 0, ""
    n = max(len(da), len(db))
    for i in range(n):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry + (delta if i == wrong_column else 0)
        so_far = (str(s) if i == n - 1 else str(s % 10)) + so_far
        lines.append(f"{x}+{y}+{carry}={s} {so_far}")
        carry = s // 10
    return lines, int(so_far)


def cot_response(a: int, b: int) -> str:
    """The reference chain of thought for a + b (non-negative ints), ending in ``Answer: <a+b>``."""
    lines, total = cot_lines(a, b)
    return "\n".join(lines + [f"Answer: {total}"])


def make_problem(rng: random.Random, digits: int) -> tuple[str, str, str]:
    """(prompt, answer, cot_response) of one random problem; prompt is the rendered template."""
    a, b = sample_operand(rng, digits), sample_operand(rng, digits)
    return apply_template("arith", problem_text(a, b)), str(a + b), cot_response(a, b)


def extract_answer(response: str) -> str | None:
    """The integer on the last non-empty line if it reads ``Answer: <n>``, else None."""
    lines = [ln for ln in response.strip().split("\n") if ln.strip()]
    if not lines:
        return None
    m = ANSWER_RE.match(lines[-1].strip())
    return m.group(1) if m else None


def _unique_pairs(rng: random.Random, digits: int, n: int, taken: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * (n + 100):
            raise ValueError(f"arith: cannot draw {n} distinct new problems with digits={digits} "
                             f"({len(taken)} already used); lower the counts or raise digits")
        pair = (sample_operand(rng, digits), sample_operand(rng, digits))
        if pair not in taken:
            taken.add(pair)
            out.append(pair)
    return out


def write_task_files(out_dir: str | Path, n_sft: int, n_train: int, n_eval: int, seed: int,
                     digits: int = 3) -> dict[str, Path]:
    """Write ``sft.jsonl``, ``train.jsonl`` and ``eval.jsonl`` with pairwise-disjoint problems.

    sft rows: ``id, prompt (rendered), response (CoT, no EOS), problem, answer``.
    train / eval rows: ``id, problem, answer, data_source="arith"`` (render with template arith).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    taken: set[tuple[int, int]] = set()
    splits = {"eval": _unique_pairs(rng, digits, n_eval, taken),
              "train": _unique_pairs(rng, digits, n_train, taken),
              "sft": _unique_pairs(rng, digits, n_sft, taken)}
    return write_splits(out, splits)


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    """The quickstart's split sizes (12000 SFT, 4000 train, 200 eval) at the run's seed."""
    write_task_files(out_dir, n_sft=12000, n_train=4000, n_eval=200, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register("arith")(QuickstartTask(write_files=write_quickstart_files))


def write_splits(out: Path, splits: dict[str, list[tuple[int, int]]]) -> dict[str, Path]:
    """<out>/<split>.jsonl for each split's (a, b) pairs, rows as `write_task_files` describes."""
    paths = {}
    for split, pairs in splits.items():
        path = out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i, (a, b) in enumerate(pairs):
                problem = problem_text(a, b)
                row = {"id": f"arith-{split}-{i}", "problem": problem, "answer": str(a + b)}
                if split == "sft":
                    row |= {"prompt": apply_template("arith", problem), "response": cot_response(a, b)}
                else:
                    row["data_source"] = DATA_SOURCE
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[split] = path
    return paths
