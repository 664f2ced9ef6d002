"""Quickstart task for Pairwise-RL (docs/algorithms.md §6): a preference task whose quality rule is hidden.

Prompt (template ``raw``): four distinct digits and a colon, ``"4179:"``. Response: an arrangement
of those digits, ``"9741"``. Nothing tells the policy what a good arrangement is. The HIDDEN rule
(`hidden_score`) is a positional weighted sum, min-max normalised over the prompt's arrangements:

    S(r) = sum_i (n - 1 - i) * r_i                     (i = 0 .. n-1, n = 4 digits)
    hidden_score(r) = (S(r) - S(ascending)) / (S(descending) - S(ascending))   in [0, 1],

so sorting the digits in descending order scores 1, ascending 0. A response that is not an
arrangement of the prompt's digits scores 0. The rule is linear in per-token features (digit x
position weight), which a 3-layer judge can learn from pairs, and every digit's placement moves
it, which gives the policy graded credit.

The rule is used only (a) to label preference pairs for the judge (`judge_pairs`) and (b) as the
eval-only reward `hidden_rule_reward` (eval rows have data_source ``pairwise_pref_hidden``), so
``eval/pairwise_pref/score`` is the greedy policy's mean hidden score and ``eval/accuracy`` the
share of perfectly sorted responses. RL training rows (data_source ``pairwise_pref``) are scored
by the trained judge (reward ``pairwise_genrm``) against the row's anchor: its ``reference``, the
arrangement whose hidden score is nearest 0.5 (a mid-quality response, ties broken at random).

Splits (disjoint sets of prompts, drawn from the 5040 ordered 4-digit prompts): eval 200, judge
held-out 300, train 1500, and the rest for the policy's SFT (each prompt with two uniformly random
arrangements: a warm start of mixed hidden quality, mean 0.5) and the judge's training pairs.
Judge pairs: two different candidates per pair, each a uniformly random arrangement, or with
probability `INVALID_FRAC` an invalid one (a digit replaced by one not in the prompt, or a digit
repeated) so that the judge learns to rank non-arrangements last; pairs with equal hidden scores
are skipped. (The candidates are drawn like the SFT policy's own samples instead of being sampled
from it: the same distribution, without an engine pass.)
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from megarl.config import MegaRLConfig
from megarl.rewards.types import RewardInput, RewardOutput
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask

log = logging.getLogger(__name__)

DATA_SOURCE = "pairwise_pref"  # RL rows: judged against their anchor
EVAL_SOURCE = "pairwise_pref_hidden"  # eval rows: the hidden rule
N_DIGITS = 4
INVALID_FRAC = 0.15
SPLITS = {"eval": 200, "judge_eval": 300, "train": 1500}  # the rest: SFT and judge training prompts


# ---------------------------------------------------------------------------- the hidden rule

def problem_text(digits: str) -> str:
    return f"{digits}:"


def digits_of(problem: str) -> str:
    """The digits of a problem text (``"4179:"`` -> ``"4179"``)."""
    return problem.strip().rstrip(":")


def weighted_sum(seq: str) -> int:
    """S = sum_i (n - 1 - i) * digit_i."""
    n = len(seq)
    return sum((n - 1 - i) * int(c) for i, c in enumerate(seq))


def is_arrangement(digits: str, response: str) -> bool:
    return len(response) == len(digits) and sorted(response) == sorted(digits)


def hidden_score(digits: str, response: str) -> float:
    """(S(r) - S(asc)) / (S(desc) - S(asc)) for an arrangement r of `digits` (surrounding
    whitespace ignored), else 0. `digits` must be distinct digits."""
    if not digits.isdigit() or len(set(digits)) != len(digits) or len(digits) < 2:
        raise ValueError(f"pairwise_pref: prompt digits must be >= 2 distinct digits, got {digits!r}")
    r = response.strip()
    if not is_arrangement(digits, r):
        return 0.0
    lo, hi = weighted_sum("".join(sorted(digits))), weighted_sum("".join(sorted(digits, reverse=True)))
    return (weighted_sum(r) - lo) / (hi - lo)


def hidden_rule_reward(x: RewardInput) -> RewardOutput:
    """Eval-only reward (reward fn ``megarl.tasks.pairwise_pref:hidden_rule_reward``): the hidden
    score of the response for the digits in the row's answer; correct = perfectly sorted."""
    if x.gold is None:
        raise ValueError("pairwise_pref hidden rule: the row has no answer (its digits)")
    score = hidden_score(x.gold, x.response)
    return RewardOutput(score, score == 1.0, {"valid": is_arrangement(x.gold, x.response.strip())})


# ---------------------------------------------------------------------------- responses and anchors

def random_arrangement(rng: random.Random, digits: str) -> str:
    d = list(digits)
    rng.shuffle(d)
    return "".join(d)


def invalid_response(rng: random.Random, digits: str) -> str:
    """An arrangement with one digit replaced by a digit not in the prompt, or by a repeat of
    another digit of it (never an arrangement)."""
    r = list(random_arrangement(rng, digits))
    i = rng.randrange(len(r))
    if rng.random() < 0.5:
        r[i] = rng.choice([c for c in "0123456789" if c not in digits])
    else:
        r[i] = rng.choice([c for c in r if c != r[i]])
    return "".join(r)


def anchor_response(rng: random.Random, digits: str) -> str:
    """The arrangement whose hidden score is nearest 0.5 (a mid-quality anchor; random among ties)."""
    from itertools import permutations

    perms = ["".join(p) for p in permutations(digits)]
    best = min(abs(hidden_score(digits, p) - 0.5) for p in perms)
    return rng.choice([p for p in perms if abs(hidden_score(digits, p) - 0.5) == best])


def judge_pairs(rng: random.Random, prompts: list[str], pairs_per_prompt: int,
                invalid_frac: float = INVALID_FRAC) -> list[dict[str, str]]:
    """Preference pairs {prompt, chosen, rejected} labelled by the hidden rule: for each prompt
    (digits) `pairs_per_prompt` draws of two different candidates (random arrangements, each
    invalid with probability `invalid_frac`); draws with equal hidden scores are skipped."""
    out = []
    for digits in prompts:
        for _ in range(pairs_per_prompt):
            a, b = (invalid_response(rng, digits) if rng.random() < invalid_frac else random_arrangement(rng, digits)
                    for _ in range(2))
            sa, sb = hidden_score(digits, a), hidden_score(digits, b)
            if sa == sb:
                continue
            chosen, rejected = (a, b) if sa > sb else (b, a)
            out.append({"prompt": problem_text(digits), "chosen": chosen, "rejected": rejected})
    return out


# ---------------------------------------------------------------------------- files

def split_prompts(seed: int, n_digits: int = N_DIGITS) -> dict[str, list[str]]:
    """Every ordered prompt of `n_digits` distinct digits, shuffled and cut into SPLITS + rest."""
    from itertools import permutations

    prompts = ["".join(p) for p in permutations("0123456789", n_digits)]
    random.Random(seed).shuffle(prompts)
    out, at = {}, 0
    for name, n in SPLITS.items():
        out[name], at = prompts[at:at + n], at + n
    out["rest"] = prompts[at:]
    return out


def write_task_files(out_dir: str | Path, seed: int, sft_per_prompt: int = 2,
                     judge_pairs_per_prompt: int = 4) -> dict[str, Path]:
    """sft.jsonl (prompt, response), train.jsonl (problem, answer = the digits, reference = the
    anchor, data_source pairwise_pref), eval.jsonl (the same, data_source pairwise_pref_hidden),
    judge_train.jsonl and judge_eval.jsonl (preference pairs: prompt, chosen, rejected)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    splits = split_prompts(seed)
    rows: dict[str, list[dict[str, Any]]] = {
        "sft": [{"prompt": problem_text(d), "response": random_arrangement(rng, d)}
                for d in splits["rest"] for _ in range(sft_per_prompt)],
        "train": [{"id": f"pp-train-{i}", "problem": problem_text(d), "answer": d, "data_source": DATA_SOURCE,
                   "reference": anchor_response(rng, d)} for i, d in enumerate(splits["train"])],
        "eval": [{"id": f"pp-eval-{i}", "problem": problem_text(d), "answer": d, "data_source": EVAL_SOURCE}
                 for i, d in enumerate(splits["eval"])],
        "judge_train": judge_pairs(rng, splits["rest"], judge_pairs_per_prompt),
        "judge_eval": judge_pairs(rng, splits["judge_eval"], 1),
    }
    paths = {}
    for name, items in rows.items():
        paths[name] = out / f"{name}.jsonl"
        with paths[name].open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
    return paths


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    write_task_files(out_dir, seed=cfg.trainer.seed)


def train_judge_before_rl(cfg: MegaRLConfig, run_dir: Path, sft_out: dict) -> None:
    """Quickstart hook (every rank, after the policy's SFT): trains the pairwise judge on the
    task's preference pairs from the SFT policy's checkpoint, exports it to <run_dir>/judge/hf,
    prints its held-out accuracy (both orders) and points reward.judge_path at it.
    A judge of an earlier attempt of this run dir (its judge_eval.json written) is reused."""
    from megarl.trainer.genrm_train import train_pairwise_judge

    task, judge_dir = run_dir / "task", run_dir / "judge"
    done = judge_dir / "judge_eval.json"
    if done.exists():
        result = json.loads(done.read_text())
        if dist_rank() == 0:
            print(f"genrm: reusing {result['hf_dir']} (held-out pairwise accuracy {result['accuracy']:.3f})", flush=True)
    else:
        result = train_pairwise_judge(cfg, task / "judge_train.jsonl", task / "judge_eval.jsonl", judge_dir,
                                      init_load=sft_out["checkpoint"])
    cfg.reward["judge_path"] = result["hf_dir"]


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


QUICKSTART_TASKS.register("pairwise_pref")(QuickstartTask(
    write_files=write_quickstart_files, before_rl=train_judge_before_rl, table_metrics=("eval/pairwise_pref/score",)))
