"""Reward inputs, outputs and the errors reward functions raise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardInput:
    """One sample to score.

    `gold` is the ground-truth answer (math) or None. `reference` is a reference response
    (GenRM compares against it, 0.5 = parity; Pairwise-RL's anchor); when it is None GenRM
    falls back to `gold`. `extra` carries source-specific data, e.g. `extra["tests"]` for code.
    """

    data_source: str
    prompt: str
    response: str
    gold: str | None = None
    reference: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardOutput:
    """`score` is the scalar reward; `acc` is correctness for dynamic sampling (DAPO filters
    on it, docs/algorithms.md §2), None where the reward has no notion of correctness."""

    score: float
    acc: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)


class RewardError(Exception):
    """A reward could not be computed (bad data, judge produced no verdict, ...)."""


class RewardTimeout(RewardError):
    """A reward check ran past its hard time limit."""
