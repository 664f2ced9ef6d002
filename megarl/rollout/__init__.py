"""Rollout engines (DESIGN.md: RolloutEngine contract)."""

from megarl.rollout.types import RolloutEngine, Sample, SamplingParams

__all__ = ["RolloutEngine", "Sample", "SamplingParams"]
