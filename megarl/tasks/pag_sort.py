"""Quickstart task for PAG where checking is easier than solving: sort digits.

Prompt (template ``raw``): ``"sort 52819\\n"`` (5 distinct digits 1-9). Turns:

    Answer: 12589<eos>                    solution: the digits in ascending order, in one go
    <verify instruction>
    1 in ok                               verification (`checks`): each answer digit is in the
    ...                                   prompt, each adjacent pair ascends, the digit count
    1<2 ok                                matches; `no` at the first failure (nothing after it),
    ...                                   then the verdict phrase
    5 digits ok
    The answer is correct<eos>
    <revise instruction>                  (only after "The answer is wrong")
    Answer: 12589<eos>                    revision

Producing the order needs every digit at once; each check is one lookup or one comparison of
digits just written. (On the addition task, `pag_arith`, the verifier shared the solver's wrong
column sums and never learned to tell right from wrong answers.) Rows: ``id, problem, answer (the
sorted digits), data_source="pag_sort"``; the math verifier scores ``Answer: <n>`` (no zeros, so a
number equals the answer only with the same digits).
"""

from __future__ import annotations

import random
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask
from megarl.tasks.pag_arith import answer_sft_row, pag_table_metrics, with_verdict, write_pag_files

DATA_SOURCE = "pag_sort"
N_DIGITS = 5
ROW_KINDS = {"solution": 0.15, "verification": 0.7, "revision": 0.15}  # share of SFT rows of each turn kind
TABLE_METRICS = pag_table_metrics(DATA_SOURCE)


def problem_text(digits: str) -> str:
    return f"sort {digits}\n"


def wrong_answer(digits: str, rng: random.Random) -> str:
    """A wrong answer of the kinds a sorter makes (never the sorted digits): two adjacent digits
    swapped, one digit written twice in place of another, one replaced by a digit the prompt does
    not have (still ascending), or one left out."""
    d = sorted(digits)
    i = rng.randrange(len(d) - 1)
    kind = rng.randrange(4)
    if kind == 0:
        d[i], d[i + 1] = d[i + 1], d[i]
    elif kind == 1:
        d[i] = d[i + 1]
    elif kind == 2:
        d[i] = rng.choice([c for c in "123456789" if c not in digits])
        d.sort()
    else:
        del d[i]
    return "".join(d)


def checks(digits: str, answer: str) -> list[str]:
    """The verifier's checks of `answer` for prompt `digits`, each decided by what was just written,
    stopping at the first failure (`no`): every answer digit is in the prompt (`8 in no`), every
    adjacent pair ascends (`9<8 no`), and there are as many digits as in the prompt (`4 digits no`).
    All pass only for the sorted prompt digits."""
    out = []
    for c in answer:
        out.append(f"{c} in {'ok' if c in digits else 'no'}")
        if c not in digits:
            return out
    for a, b in zip(answer, answer[1:]):
        out.append(f"{a}<{b} {'ok' if a < b else 'no'}")
        if a >= b:
            return out
    out.append(f"{len(answer)} digits {'ok' if len(answer) == len(digits) else 'no'}")
    return out


def verification(digits: str, answer: str) -> str:
    return with_verdict(checks(digits, answer))


def sft_row(digits: str, kind: str, rng: random.Random, verify: str, revise: str) -> dict:
    """{prompt, response} of one SFT row of `kind` (solution | verification | revision)."""
    return answer_sft_row(DATA_SOURCE, problem_text(digits), "".join(sorted(digits)),
                          lambda r: wrong_answer(digits, r), lambda ans: verification(digits, ans),
                          kind, rng, verify, revise)


def write_task_files(out_dir: str | Path, verify: str, revise: str, n_sft: int = 12000, n_train: int = 2000,
                     n_eval: int = 200, seed: int = 1) -> dict[str, Path]:
    """sft.jsonl (id, kind, prompt, response, problem, answer), train.jsonl and eval.jsonl (id,
    problem, answer, data_source); eval and train prompts are disjoint, SFT rows may repeat them
    (15,120 prompts in all)."""
    from itertools import permutations

    rng = random.Random(seed)
    prompts = ["".join(p) for p in permutations("123456789", N_DIGITS)]
    rng.shuffle(prompts)
    return write_pag_files(out_dir, DATA_SOURCE, prompts, problem_text, lambda d: "".join(sorted(d)),
                           lambda d, kind, r: sft_row(d, kind, r, verify, revise), ROW_KINDS, rng,
                           n_sft, n_train, n_eval)


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    g = cfg.algorithm.pag
    write_task_files(out_dir, g.verify_instruction, g.revise_instruction, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register("pag_sort")(QuickstartTask(write_files=write_quickstart_files, table_metrics=TABLE_METRICS))
