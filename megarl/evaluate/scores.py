"""Eval-set statistics from per-sample results, pure Python.

For one prompt with n samples of which c are correct:

- avg@n: c / n (pass@1 averaged over the n samples; the trainer's eval/<set>/accuracy);
- pass@k (k <= n): 1 - C(n-c, k) / C(n, k), the unbiased estimate of "one of k samples is correct"
  (Chen et al. 2021, the Codex paper);
- maj@n: the answer most samples give (extracted and normalised; ties go to the answer seen
  first) is correct, i.e. a sample giving it is correct. Samples without an extractable answer do
  not vote; a prompt where none has one counts as wrong.

A set's value is the mean over its prompts. Response length is the mean number of response tokens
over all samples; truncated is the share of samples stopped by the token cap (finish_reason
"length").
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb


@dataclass
class SampleResult:
    uid: str
    acc: bool
    score: float
    answer: str | None  # the extracted, normalised answer (majority vote), None when there is none
    length: int  # response tokens
    truncated: bool


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(samples: list[SampleResult]) -> bool:
    votes: dict[str, list[SampleResult]] = {}
    for s in samples:
        if s.answer is not None:
            votes.setdefault(s.answer, []).append(s)
    if not votes:
        return False
    top = max(votes.values(), key=len)  # max keeps the first of equal counts: the answer seen first
    return any(s.acc for s in top)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def summarize(results: list[SampleResult]) -> dict[str, float]:
    """avg@n, pass@k for k in ks_for(n), maj@n, score, response_length, truncated of one eval
    set; every prompt must have the same number of samples n."""
    groups: dict[str, list[SampleResult]] = {}
    for r in results:
        groups.setdefault(r.uid, []).append(r)
    if not groups:
        raise ValueError("no samples to summarise")
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"prompts have different numbers of samples: {sorted(sizes)}")
    (n,) = sizes
    prompts = list(groups.values())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {"prompts": float(len(prompts)), "n": float(n), f"avg@{n}": mean([mean([s.acc for s in g]) for g in prompts])}
    for k in ks_for(n):
        out[f"pass@{k}"] = mean([pass_at_k(n, sum(s.acc for s in g), k) for g in prompts])
    out[f"maj@{n}"] = mean([float(majority_correct(g)) for g in prompts])
    out["score"] = mean([s.score for s in results])
    out["response_length"] = mean([s.length for s in results])
    out["truncated"] = mean([float(s.truncated) for s in results])
    return out
