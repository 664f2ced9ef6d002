"""Quickstart task for PAG with a verifier that does not share the solver's mistakes: pair sums.

Prompt (template ``raw``): ``"sum 9 in 38152\\n"`` (5 distinct digits 1-9; exactly one pair of them
sums to the target). Turns:

    Answer: 18<eos>                       solution: the pair's digits, ascending, in one go
    <verify instruction>
    3- 8+ 1+ 5- 2-                        verification (`checks`): each prompt digit marked `+` when
    2 found ok                            the answer holds it, the count of marked digits (2), the
    1+8=9 ok                              answer's sum against the target, and the order; `no` at
    1<8 ok                                the first failure (nothing after it), then the verdict
    The answer is correct<eos>
    <revise instruction>                  (only after "The answer is wrong")
    Answer: 18<eos>                       revision

Finding the pair is a search over the prompt; the solver's typical error is a digit and its
complement with one of them absent from the prompt (``Answer: 49`` for ``sum 13 in 18542``).
Checking runs the other way round: it walks the prompt's digits and looks each up in the two-digit
answer, so a digit the solver imagined is never found (``1 found no``). Asking instead whether each
answer digit is in the prompt (`pag_sort`) repeats the solver's own lookup, and the tiny checker
then passed exactly the digits its solver had imagined (README, "The rest of the Seed family in
the loop"). Rows: ``id, problem, answer (the pair's digits, ascending), data_source="pag_pairsum"``;
the math verifier scores ``Answer: <n>``.
"""

from __future__ import annotations

import random
from itertools import combinations, permutations
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask
from megarl.tasks.pag_arith import answer_sft_row, pag_table_metrics, with_verdict, write_pag_files

DATA_SOURCE = "pag_pairsum"
N_DIGITS = 5
ROW_KINDS = {"solution": 0.3, "verification": 0.5, "revision": 0.2}  # share of SFT rows of each turn kind
TABLE_METRICS = pag_table_metrics(DATA_SOURCE)
Problem = tuple[str, int]  # (the prompt's digits, the target sum)


def pairs_summing(digits: str, target: int) -> list[str]:
    """Every ascending pair of `digits` (as a 2-character string) whose digits sum to `target`."""
    return [a + b for a, b in combinations(sorted(digits), 2) if int(a) + int(b) == target]


def all_problems() -> list[Problem]:
    """Every (5 distinct digits 1-9 in order, target) whose digits hold exactly one pair summing to
    the target (110,400)."""
    return [(d, s) for d in map("".join, permutations("123456789", N_DIGITS)) for s in range(3, 18)
            if len(pairs_summing(d, s)) == 1]


def problem_text(problem: Problem) -> str:
    digits, target = problem
    return f"sum {target} in {digits}\n"


def answer(problem: Problem) -> str:
    return pairs_summing(*problem)[0]


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong answer of the kinds a pair finder makes (never the answer): 45% a digit with its
    complement to the target where one of the two is not in the prompt (the tiny solver's own error;
    another pair when no such digit exists), 35% another pair of prompt digits, 20% the pair in
    descending order."""
    digits, target = problem
    right, u = answer(problem), rng.random()
    if u < 0.45:
        imagined = [f"{a}{target - a}" for a in range(1, 10) if a < target - a <= 9
                    and (str(a) in digits) != (str(target - a) in digits)]
        if imagined:
            return rng.choice(imagined)
    if u < 0.8:
        return rng.choice([p for p in map("".join, combinations(sorted(digits), 2)) if p != right])
    return right[::-1]


def checks(problem: Problem, ans: str) -> list[str]:
    """The verifier's checks of `ans` for `problem`, stopping at the first failure (`no`): two
    different digits (`3 digits no`); each prompt digit marked `+` if the answer holds it, else `-`;
    the number of marked digits (`1 found no`); their sum against the target (`4+8=12 no`); the
    order (`8<1 no`). All pass only for the answer."""
    digits, target = problem
    if len(ans) != 2 or ans[0] == ans[1]:
        return [f"{len(set(ans))} digits no"]
    found = sum(c in ans for c in digits)
    out = [" ".join(f"{c}{'+' if c in ans else '-'}" for c in digits), f"{found} found {'ok' if found == 2 else 'no'}"]
    if found != 2:
        return out
    a, b = ans
    total = int(a) + int(b)
    out.append(f"{a}+{b}={total} {'ok' if total == target else 'no'}")
    if total != target:
        return out
    out.append(f"{a}<{b} {'ok' if a < b else 'no'}")
    return out


def verification(problem: Problem, ans: str) -> str:
    return with_verdict(checks(problem, ans))


def sft_row(problem: Problem, kind: str, rng: random.Random, verify: str, revise: str) -> dict:
    """{prompt, response} of one SFT row of `kind` (solution | verification | revision)."""
    return answer_sft_row(DATA_SOURCE, problem_text(problem), answer(problem),
                          lambda r: wrong_answer(problem, r), lambda ans: verification(problem, ans),
                          kind, rng, verify, revise)


def write_task_files(out_dir: str | Path, verify: str, revise: str, n_sft: int = 20000, n_train: int = 2000,
                     n_eval: int = 200, seed: int = 1) -> dict[str, Path]:
    """sft.jsonl (id, kind, prompt, response, problem, answer), train.jsonl and eval.jsonl (id,
    problem, answer, data_source); the three draw disjoint problems from one shuffle (the same
    digits may come back in another order or with another target)."""
    rng = random.Random(seed)
    problems = all_problems()
    rng.shuffle(problems)
    return write_pag_files(out_dir, DATA_SOURCE, problems, problem_text, answer,
                           lambda p, kind, r: sft_row(p, kind, r, verify, revise), ROW_KINDS, rng,
                           n_sft, n_train, n_eval)


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    g = cfg.algorithm.pag
    write_task_files(out_dir, g.verify_instruction, g.revise_instruction, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register(DATA_SOURCE)(QuickstartTask(write_files=write_quickstart_files, table_metrics=TABLE_METRICS))
