"""Quickstart task `code_lines`: straight-line Python programs, unit-tested in the sandbox (the code
PRM quickstart, docs/algorithms.md §10).

Prompt (rendered, template ``raw``): four variables (values 10..99, in a..d order; `prompt_text`
can shuffle them) and an expression over them, left-associated with random operators from + - *::

    a=47 b=85 c=61 d=9
    ((a+b)*c)-d

Reference response: a fenced block with one assignment per operator, the values looked up and
written as literals, then the print (one line per step, so an error sits at a specific line)::

    ```
    x = 47+85
    y = x*61
    z = y-9
    print(z)
    ```

Unit test: the sandbox runs the last fenced block (megarl.rewards.code, all-or-nothing) and
compares its stdout with the value of the expression. Rows: ``id, problem (the rendered prompt),
answer (the expected stdout), tests ([{"stdin": "", "stdout": ...}]), data_source="code"``; the
reward section routes `code` to the `code` reward. Each line copies one value and one operator
from the prompt, so the tiny model's errors are wrong copies at specific lines: an error at line
j makes every completion fail (the variables are never reassigned), which is what the PRM's
binary-search labels find. (With the variables shuffled, each line needs a lookup by name, which
the tiny model does not learn in a quickstart's SFT: 0 of 192 sampled programs passed.)

Before RL (`before_rl`), with prm.dense_reward or prm.init_critic, the PRM is labelled and trained
by megarl.trainer.prm.ensure_prm (unless prm.path already holds one).
"""

from __future__ import annotations

import random
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask, write_disjoint_splits

DATA_SOURCE = "code"
NAMES = ("a", "b", "c", "d")
TEMPS = ("x", "y", "z")
OPS = ("+", "-", "*")
MIN_VALUE, MAX_VALUE = 10, 99  # fixed-width (2-digit) values: the tiny model learns to copy them (with 1..99 it had not after 120 SFT steps)


def make_problem(rng: random.Random) -> tuple[dict[str, int], list[str]]:
    """(values of a..d, the three operators)."""
    return {n: rng.randint(MIN_VALUE, MAX_VALUE) for n in NAMES}, [rng.choice(OPS) for _ in TEMPS]


def prompt_text(values: dict[str, int], ops: list[str], rng: random.Random, shuffle: bool = False) -> str:
    """The variables (in a..d order, or shuffled: a lookup by name, too hard for the tiny model's
    short SFT) and the expression."""
    order = list(NAMES)
    if shuffle:
        rng.shuffle(order)
    expr = f"(({NAMES[0]}{ops[0]}{NAMES[1]}){ops[1]}{NAMES[2]}){ops[2]}{NAMES[3]}"
    return " ".join(f"{n}={values[n]}" for n in order) + "\n" + expr + "\n"


def program_lines(values: dict[str, int], ops: list[str]) -> list[str]:
    lines = [f"{TEMPS[0]} = {values[NAMES[0]]}{ops[0]}{values[NAMES[1]]}"]
    for k in (1, 2):
        lines.append(f"{TEMPS[k]} = {TEMPS[k - 1]}{ops[k]}{values[NAMES[k + 1]]}")
    return lines + [f"print({TEMPS[-1]})"]


def reference_response(values: dict[str, int], ops: list[str]) -> str:
    return "```\n" + "\n".join(program_lines(values, ops)) + "\n```"


def expected_output(values: dict[str, int], ops: list[str]) -> str:
    """The expression's value, computed here without running any code."""
    acc = values[NAMES[0]]
    for op, name in zip(ops, NAMES[1:]):
        v = values[name]
        acc = acc + v if op == "+" else acc - v if op == "-" else acc * v
    return str(acc)


def write_task_files(out_dir: str | Path, n_sft: int, n_train: int, n_eval: int, seed: int) -> dict[str, Path]:
    """``sft.jsonl`` (prompt, response), ``train.jsonl`` and ``eval.jsonl`` (code rows, see the
    module doc) with pairwise-disjoint problems."""
    rng = random.Random(seed)

    def draw():
        values, ops = make_problem(rng)
        prompt = prompt_text(values, ops, rng)
        return prompt.split("\n")[1] + str(sorted(values.items())), (values, ops, prompt)

    def make_row(split, i, problem):
        values, ops, prompt = problem
        row = {"id": f"code-{split}-{i}", "problem": prompt, "answer": expected_output(values, ops)}
        if split == "sft":
            return row | {"prompt": prompt, "response": reference_response(values, ops)}
        return row | {"tests": [{"stdin": "", "stdout": row["answer"]}], "data_source": DATA_SOURCE}

    return write_disjoint_splits(out_dir, {"eval": n_eval, "train": n_train, "sft": n_sft}, draw, make_row)


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    write_task_files(out_dir, n_sft=8000, n_train=2000, n_eval=128, seed=cfg.trainer.seed)


def before_rl(cfg: MegaRLConfig, run_dir: Path, sft_out: dict) -> None:
    from megarl.trainer.prm import ensure_prm

    ensure_prm(cfg, run_dir)


QUICKSTART_TASKS.register("code_lines")(QuickstartTask(write_files=write_quickstart_files, before_rl=before_rl))
