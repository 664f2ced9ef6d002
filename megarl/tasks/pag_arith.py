"""Quickstart task for PAG (docs/algorithms.md §8): the addition chain of thought of megarl.tasks.arith,
solved, self-verified and (only when the verification says wrong) revised in one trajectory.

Turns (the instructions are algorithm.pag.verify_instruction / revise_instruction, template tokens;
configs/quickstart/pag.yaml sets short ones because the tiny model's context is 256 tokens and the
paper's verify instruction alone is 243):

    Q: 347+856=?\\n                       prompt (template arith)
    7+6+0=13 3 ... Answer: 1203<eos>      solution: arith.cot_response
    <verify instruction>
    7+6+0=13 ok                           verification: each column line's sum checked
    4+5+1=10 ok                           (`line_checks`, stopping at the first "no"), and the
    3+8+1=12 ok                           verdict phrase
    The answer is correct<eos>
    <revise instruction>                  (only after "The answer is wrong")
    ...Answer: 1203<eos>                  revision: the chain of thought

SFT warm start (sft.jsonl, one row per problem, the turns before the trained one in the prompt,
the solution's end-of-text token included as the rollout has it): solution rows; verification rows
of a correct solution (-> "correct") or of a solution with one wrong column sum (-> "wrong");
revision rows (a wrong solution, its "wrong" verification, the correct chain of thought). Short
SFT (configs/quickstart/pag.yaml) leaves the solver and the verifier imperfect. The line checks
see wrong column sums only: a misread operand digit (a right sum of the wrong digits) passes them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.data.templates import apply_template
from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask
from megarl.tasks.arith import _unique_pairs, cot_lines, cot_response, write_splits
from megarl.tasks.tiny_model import EOS_TOKEN

ROW_KINDS = {"solution": 0.5, "verification": 0.3, "revision": 0.2}  # share of SFT rows of each turn kind


def pag_sft_row(task: str, prompt: str, solution: str, wrong_solution, verification, kind: str,
                rng: random.Random, verify: str, revise: str) -> dict:
    """{prompt, response} of one SFT row of `kind` of PAG `task`: solution (`solution`, the right
    response); verification of the right response or (half the rows) of `wrong_solution(rng)`, with
    `verification(shown response)` as the response; revision: a wrong response, its verification
    and the right one (the turns before the trained one in the prompt, with their end-of-text tokens)."""
    if kind == "solution":
        return {"prompt": prompt, "response": solution}
    if kind == "verification":
        shown = solution if rng.random() < 0.5 else wrong_solution(rng)
        return {"prompt": prompt + shown + EOS_TOKEN + verify, "response": verification(shown)}
    if kind == "revision":
        shown = wrong_solution(rng)
        context = prompt + shown + EOS_TOKEN + verify + verification(shown) + EOS_TOKEN + revise
        return {"prompt": context, "response": solution}
    raise ValueError(f"{task}: unknown SFT row kind {kind!r}")


def answer_sft_row(task: str, prompt: str, right: str, wrong_answer, verification, kind: str,
                   rng: random.Random, verify: str, revise: str) -> dict:
    """`pag_sft_row` for a task whose solution is `Answer: <right>` and whose verifier turn
    `verification(answer)` reads the answer alone; `wrong_answer(rng)` draws a wrong answer."""
    return pag_sft_row(task, prompt, f"Answer: {right}", lambda r: f"Answer: {wrong_answer(r)}",
                       lambda shown: verification(shown.removeprefix("Answer: ")), kind, rng, verify, revise)


def write_pag_files(out_dir: str | Path, task: str, problems: list, problem_text, answer, sft_row,
                    row_kinds: dict[str, float], rng: random.Random, n_sft: int, n_train: int,
                    n_eval: int) -> dict[str, Path]:
    """eval.jsonl and train.jsonl (id, problem, answer, data_source=task) from the first n_eval and
    the next n_train of the (shuffled) `problems`, and sft.jsonl (id, kind, prompt, response,
    problem, answer): n_sft rows cycling over the rest, each of a kind drawn with `row_kinds`'
    weights and built by `sft_row(problem, kind, rng)`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"eval": problems[:n_eval], "train": problems[n_eval:n_eval + n_train]}
    rest = problems[n_eval + n_train:]
    paths = {}
    for name, items in splits.items():
        paths[name] = out / f"{name}.jsonl"
        with paths[name].open("w", encoding="utf-8") as f:
            for i, x in enumerate(items):
                f.write(json.dumps({"id": f"{task}-{name}-{i}", "problem": problem_text(x), "answer": answer(x),
                                    "data_source": task}) + "\n")
    kinds = list(row_kinds)
    paths["sft"] = out / "sft.jsonl"
    with paths["sft"].open("w", encoding="utf-8") as f:
        for i in range(n_sft):
            x = rest[i % len(rest)]
            kind = rng.choices(kinds, weights=list(row_kinds.values()))[0]
            f.write(json.dumps({"id": f"{task}-sft-{i}", "kind": kind, **sft_row(x, kind, rng),
                                "problem": problem_text(x), "answer": answer(x)}) + "\n")
    return paths


def pag_table_metrics(task: str) -> tuple[str, ...]:
    """The eval metrics a PAG task's quickstart table shows (megarl.trainer.pag.turn_stats)."""
    return tuple(f"eval/{task}/{k}" for k in (
        "first_accuracy", "verify_accuracy", "verify_on_correct", "verify_on_wrong", "revised_frac", "final_accuracy"))


def with_verdict(checks: list[str]) -> str:
    """Check lines (each ending in `ok` or, the last one possibly, `no`) and the verdict they imply."""
    verdict = VERDICT_WRONG if checks and checks[-1].endswith(" no") else VERDICT_CORRECT
    return "\n".join(checks + [verdict])


TABLE_METRICS = pag_table_metrics("pag_arith")


def wrong_solution(a: int, b: int, rng: random.Random) -> tuple[str, int]:
    """A solution with one wrong column sum (off by +-1, kept in 0..19) and its (wrong) answer."""
    column = rng.randrange(max(len(str(a)), len(str(b))))
    correct_lines, _ = cot_lines(a, b)
    true_sum = int(correct_lines[column].split("=")[1].split()[0])
    delta = rng.choice([d for d in (-1, 1) if 0 <= true_sum + d <= 19])
    lines, answer = cot_lines(a, b, column, delta)
    return "\n".join(lines + [f"Answer: {answer}"]), answer


def line_checks(solution: str) -> list[str]:
    """Each column line `x+y+c=s ...` of a solution copied up to its sum and marked `ok` when
    x + y + c == s, `no` at the first line where it is not (nothing after it). The mark is decided
    by the sum the model just copied and the sum it computes itself at that spot (local); two
    earlier formats asked for a comparison of whole numbers (`1203 vs 1193`, or digit pairs after
    recomputing), which the tiny model did not learn: it gave one verdict to every answer."""
    out = []
    for line in solution.split("\n"):
        if line.startswith("Answer:"):
            break
        lhs, s = line.split(" ")[0].split("=")
        ok = sum(int(v) for v in lhs.split("+")) == int(s)
        out.append(f"{lhs}={s} {'ok' if ok else 'no'}")
        if not ok:
            break
    return out


def verification(solution: str) -> str:
    """The line checks of `solution` and the verdict: correct when every column line checks."""
    return with_verdict(line_checks(solution))


def sft_row(a: int, b: int, kind: str, rng: random.Random, verify: str, revise: str) -> dict:
    """{prompt, response} of one SFT row of `kind` (solution | verification | revision)."""
    return pag_sft_row("pag_arith", apply_template("arith", f"{a}+{b}"), cot_response(a, b),
                       lambda r: wrong_solution(a, b, r)[0], verification, kind, rng, verify, revise)


def write_task_files(out_dir: str | Path, verify: str, revise: str, n_sft: int = 24000, n_train: int = 4000,
                     n_eval: int = 200, seed: int = 1, digits: int = 3) -> dict[str, Path]:
    """sft.jsonl (rows: id, kind, prompt, response, problem, answer), train.jsonl and eval.jsonl
    (arith's prompt rows, data_source arith); pairwise-disjoint problems."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    taken: set[tuple[int, int]] = set()
    splits = {"eval": _unique_pairs(rng, digits, n_eval, taken), "train": _unique_pairs(rng, digits, n_train, taken)}
    paths = write_splits(out, splits)
    kinds = list(ROW_KINDS)
    with (out / "sft.jsonl").open("w", encoding="utf-8") as f:
        for i, (a, b) in enumerate(_unique_pairs(rng, digits, n_sft, taken)):
            kind = rng.choices(kinds, weights=list(ROW_KINDS.values()))[0]
            row = {"id": f"pag_arith-sft-{i}", "kind": kind, **sft_row(a, b, kind, rng, verify, revise),
                   "problem": f"{a}+{b}", "answer": str(a + b)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    paths["sft"] = out / "sft.jsonl"
    return paths


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    g = cfg.algorithm.pag
    write_task_files(out_dir, g.verify_instruction, g.revise_instruction, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register("pag_arith")(QuickstartTask(write_files=write_quickstart_files, table_metrics=TABLE_METRICS))
