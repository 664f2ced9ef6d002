"""Pre-PPO prompt selection (docs/algorithms.md §7, arXiv 2503.22230): keep the prompts the reward
model scores lowest, after normalising scores within each task domain.

Per prompt i of domain d with sampled responses j = 1..N scored r_ij by the reward route:

    s_i = mean_j r_ij                              (prompt score)
    z_i = (s_i - mean_{k in d} s_k) / std_{k in d} s_k      (population std; 0 when std = 0)

and the selection keeps the ceil(fraction * n) prompts of lowest z (ties: lower s, then file
order). Normalising within domains is the paper's [S]; how many responses per prompt and the
cutoff are not stated [NS->C]: `fraction` defaults to 0.1 (the paper found that adding 10% new
data helped and 20% / 50% degraded), responses per prompt are the caller's choice.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence


def prompt_scores(sample_scores: Sequence[Sequence[float]]) -> list[float]:
    """s_i = mean of prompt i's response scores."""
    if any(len(s) == 0 for s in sample_scores):
        raise ValueError("prompt_scores: every prompt needs at least one scored response")
    return [sum(s) / len(s) for s in sample_scores]


def domain_zscores(scores: Sequence[float], domains: Sequence[str]) -> list[float]:
    """z_i = (s_i - mean_d) / std_d within each domain d (population std; z = 0 where std_d = 0)."""
    if len(scores) != len(domains):
        raise ValueError(f"domain_zscores: {len(scores)} scores but {len(domains)} domains")
    members: dict[str, list[int]] = defaultdict(list)
    for i, d in enumerate(domains):
        members[d].append(i)
    z = [0.0] * len(scores)
    for idx in members.values():
        mean = sum(scores[i] for i in idx) / len(idx)
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in idx) / len(idx))
        for i in idx:
            z[i] = (scores[i] - mean) / std if std > 0 else 0.0
    return z


def select_hardest(scores: Sequence[float], domains: Sequence[str], fraction: float) -> list[int]:
    """Indices (ascending) of the ceil(fraction * n) prompts with the lowest domain z-score."""
    if not 0 < fraction <= 1:
        raise ValueError(f"select_hardest: fraction must be in (0, 1], got {fraction}")
    z = domain_zscores(scores, domains)
    keep = math.ceil(fraction * len(scores))
    ranked = sorted(range(len(scores)), key=lambda i: (z[i], scores[i], i))
    return sorted(ranked[:keep])
