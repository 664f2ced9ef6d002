"""Quickstart task for PAG (ALGORITHMS.md §8): the addition chain of thought of megarl.tasks.arith,
solved, self-verified and (only when the verification says wrong) revised in one trajectory.

Turns (the instructions are algorithm.pag.verify_instruction / revise_instruction, template tokens;
configs/quickstart/pag.yaml sets short ones because the tiny model's context is 256 tokens and the
paper's verify instruction alone is 243):

    Q: 347+856=?\\n                       prompt (template arith)
    7+6+0=13 3 ... Answer: 1203<eos>      solution: arith.cot_response
    <verify instruction>
    7+6+0=13 3                            verification: the chain of thought again (re-derived,
    4+5+1=10 03                           not copied), the recomputed and the claimed answer
    3+8+1=12 1203                         compared digit by digit (`digit_check`), and the
    1=1 2=2 0=0 3=3                       verdict phrase
    The answer is correct<eos>
    <revise instruction>                  (only after "The answer is wrong")
    ...Answer: 1203<eos>                  revision: the chain of thought

SFT warm start (sft.jsonl, one row per problem, the turns before the trained one in the prompt,
the solution's end-of-text token included as the rollout has it): solution rows; verification rows
of a correct solution (-> "correct") or of a solution with one wrong column sum (-> "wrong");
revision rows (a wrong solution, its "wrong" verification, the correct chain of thought). Short
SFT (configs/quickstart/pag.yaml) leaves the solver and the verifier imperfect: a verifier that
copies the solution's lines instead of re-deriving them says "correct" to wrong answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megarl.data.templates import apply_template
from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask
from megarl.tasks.arith import _unique_pairs, cot_lines, cot_response, write_splits
from megarl.tasks.tiny_model import EOS_TOKEN

ROW_KINDS = {"solution": 0.5, "verification": 0.3, "revision": 0.2}  # share of SFT rows of each turn kind
TABLE_METRICS = tuple(f"eval/pag_arith/{k}" for k in (
    "first_accuracy", "verify_accuracy", "verify_on_correct", "verify_on_wrong", "revised_frac", "final_accuracy"))


def wrong_solution(a: int, b: int, rng: random.Random) -> tuple[str, int]:
    """A solution with one wrong column sum (off by +-1, kept in 0..19) and its (wrong) answer."""
    column = rng.randrange(max(len(str(a)), len(str(b))))
    correct_lines, _ = cot_lines(a, b)
    true_sum = int(correct_lines[column].split("=")[1].split()[0])
    delta = rng.choice([d for d in (-1, 1) if 0 <= true_sum + d <= 19])
    lines, answer = cot_lines(a, b, column, delta)
    return "\n".join(lines + [f"Answer: {answer}"]), answer


def digit_check(result: int, claimed: int) -> str:
    """The recomputed and the claimed answer compared digit by digit from the left, `r=c` for equal
    digits, `r!c` at the first difference (and nothing after it): each relation is decided by the
    two digits just written, which a tiny model learns; a verdict after "1203 vs 1193" would need
    an equality test of two whole numbers, which it did not (the SFT verifier said the same verdict
    to every answer). A length difference ends the line with the shorter number's digits."""
    pairs = []
    for r, c in zip(str(result), str(claimed)):
        pairs.append(f"{r}={c}" if r == c else f"{r}!{c}")
        if r != c:
            break
    return " ".join(pairs)


def verification(a: int, b: int, claimed: int) -> str:
    """Re-derived chain of thought, the digit check against the claimed answer, and the verdict phrase."""
    lines, result = cot_lines(a, b)
    verdict = VERDICT_CORRECT if result == claimed else VERDICT_WRONG
    return "\n".join(lines + [digit_check(result, claimed), verdict])


def sft_row(a: int, b: int, kind: str, rng: random.Random, verify: str, revise: str) -> dict:
    """{prompt, response} of one SFT row of `kind` (solution | verification | revision)."""
    prompt = apply_template("arith", f"{a}+{b}")
    solution = cot_response(a, b)
    if kind == "solution":
        return {"prompt": prompt, "response": solution}
    if kind == "verification":
        shown, claimed = (solution, a + b) if rng.random() < 0.5 else wrong_solution(a, b, rng)
        return {"prompt": prompt + shown + EOS_TOKEN + verify, "response": verification(a, b, claimed)}
    if kind == "revision":
        shown, claimed = wrong_solution(a, b, rng)
        context = prompt + shown + EOS_TOKEN + verify + verification(a, b, claimed) + EOS_TOKEN + revise
        return {"prompt": context, "response": solution}
    raise ValueError(f"pag_arith: unknown SFT row kind {kind!r}")


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


def write_quickstart_files(out_dir: Path, cfg) -> None:
    g = cfg.algorithm.pag
    write_task_files(out_dir, g.verify_instruction, g.revise_instruction, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register("pag_arith")(QuickstartTask(write_files=write_quickstart_files, table_metrics=TABLE_METRICS))
