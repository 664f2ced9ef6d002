"""Rollout engines (docs/design.md, "Contracts": RolloutEngine).

`make_engine(name, **kwargs)` picks one by config name (`rollout.engine: builtin | sglang`).
The SGLang engine is imported lazily, so this package imports without sglang installed.
"""

from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.registry import ENGINES, make_engine
from megarl.rollout.types import RolloutEngine, Sample, SamplingParams

__all__ = ["BuiltinEngine", "ENGINES", "RolloutEngine", "Sample", "SamplingParams", "make_engine"]
