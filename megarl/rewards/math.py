"""Math answer verifier and the rule-based math reward (DAPO, docs/algorithms.md §2).

`check(response, gold)` decides in this order, stopping at the first that applies:
1. no final answer in the response (`math_answer.extract_answer`) -> incorrect;
2. normalised strings are equal -> correct (normalisation only makes meaning-preserving
   rewrites, so equality implies equivalence);
3. both sides are plain integers -> integer equality (no subprocess: DAPO-Math-17k and AIME
   answers are integers, so this is the hot path during training);
4. otherwise math-verify (`parse` + `verify`) in a worker process with a hard deadline
   (`math_pool.VerifyPool`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.rewards.math_answer import as_integer, extract_answer, normalize
from megarl.rewards.math_pool import VerifyPool, default_pool
from megarl.rewards.types import RewardError, RewardOutput, RewardTimeout

DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MathVerdict:
    correct: bool
    method: str  # "no_answer" | "string" | "integer" | "math_verify"
    pred: str | None


def check(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
          pool: VerifyPool | None = None) -> MathVerdict:
    """Whether the response's final answer equals `gold`. Raises RewardTimeout when the
    math-verify check exceeds `timeout_s`, RewardError when it fails or gold is empty."""
    if not gold or not gold.strip():
        raise RewardError("math sample has an empty gold answer")
    pred = extract_answer(response)
    if pred is None:
        return MathVerdict(False, "no_answer", None)
    norm_pred, norm_gold = normalize(pred), normalize(gold)
    if norm_pred == norm_gold:
        return MathVerdict(True, "string", pred)
    int_pred, int_gold = as_integer(norm_pred), as_integer(norm_gold)
    if int_pred is not None and int_gold is not None:
        return MathVerdict(int_pred == int_gold, "integer", pred)
    if not norm_pred:
        return MathVerdict(False, "no_answer", pred)
    correct = (pool or default_pool()).verify(norm_gold, norm_pred, timeout_s)
    return MathVerdict(correct, "math_verify", pred)


def is_correct(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True iff the response's final answer (`Answer: ...` line or last `\\boxed{}`) is
    equivalent to `gold`. A timeout or a verifier failure counts as incorrect."""
    try:
        return check(response, gold, timeout_s=timeout_s).correct
    except RewardError:
        return False


@dataclass
class MathRewardParams:
    """Scores of the math reward. DAPO: +1 correct, -1 incorrect (docs/algorithms.md §2)."""

    correct_score: float = 1.0
    incorrect_score: float = -1.0
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"math reward: timeout_s must be > 0, got {self.timeout_s}")


def math_reward(response: str, gold: str | None, params: MathRewardParams,
                pool: VerifyPool | None = None) -> RewardOutput:
    """`correct_score` / `incorrect_score`, with `acc` for dynamic sampling. Raises
    RewardTimeout / RewardError (the reward manager scores those as failures)."""
    if gold is None:
        raise RewardError("math sample has no gold answer (gold is None)")
    verdict = check(response, gold, timeout_s=params.timeout_s, pool=pool)
    score = params.correct_score if verdict.correct else params.incorrect_score
    return RewardOutput(score=score, acc=verdict.correct,
                        info={"pred": verdict.pred, "method": verdict.method})


__all__ = ["MathRewardParams", "MathVerdict", "RewardTimeout", "check", "is_correct", "math_reward"]
