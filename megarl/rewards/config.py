"""Reward configuration: which reward function scores which data source.

YAML (the `reward:` section of a recipe):

    correct_score: 1.0          # math reward defaults (DAPO: +1 / -1)
    incorrect_score: -1.0
    max_workers: 8              # samples scored concurrently
    timeout_s: 60               # manager deadline per sample (per call for batch rewards)
    sources:                    # data_source (exact, or an fnmatch pattern like "math*") -> spec
      math: math                # short form: the reward function's name
      code: {fn: code, params: {timeout_s: 5, memory_mb: 512}}
      general: {fn: genrm, params: {judge: judge}, failure_score: 0.5}
    default_source: math        # route for data sources no key matches (else: counted failure)

Failure score precedence: the spec's `failure_score`, else the config's `failure_score`, else
the function's own default (math/code: their incorrect score; GenRM: 0.5).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class RewardSpec:
    fn: str  # registry name: math | code | genrm | pairwise_genrm | a registered custom one
    params: dict[str, Any] = field(default_factory=dict)
    failure_score: float | None = None
    timeout_s: float | None = None


def _default_sources() -> dict[str, RewardSpec]:
    return {"math": RewardSpec("math"), "code": RewardSpec("code")}


@dataclass
class RewardConfig:
    sources: dict[str, RewardSpec] = field(default_factory=_default_sources)
    default_source: str | None = None
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    failure_score: float | None = None
    max_workers: int = 8
    timeout_s: float = 60.0
    math_workers: int | None = None  # math-verify processes; None: MEGARL_MATH_WORKERS or min(4, cpus)

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"reward.max_workers must be >= 1, got {self.max_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.math_workers is not None and self.math_workers < 1:
            raise ValueError(f"reward.math_workers must be >= 1, got {self.math_workers}")
        if self.default_source is not None and self.default_source not in self.sources:
            raise ValueError(f"reward.default_source {self.default_source!r} is not one of the "
                             f"sources {sorted(self.sources)}")
        for name, spec in self.sources.items():
            if spec.timeout_s is not None and spec.timeout_s <= 0:
                raise ValueError(f"reward.sources.{name}.timeout_s must be > 0")

    def route(self, data_source: str) -> str | None:
        """The sources key scoring `data_source`: exact match, else the first matching
        pattern, else default_source."""
        if data_source in self.sources:
            return data_source
        for key in self.sources:
            if any(c in key for c in "*?[") and fnmatch.fnmatchcase(data_source, key):
                return key
        return self.default_source

    def params_for(self, key: str) -> dict[str, Any]:
        """The spec's params, with the top-level correct/incorrect scores filled in for math."""
        spec = self.sources[key]
        params = dict(spec.params)
        if spec.fn == "math":
            params.setdefault("correct_score", self.correct_score)
            params.setdefault("incorrect_score", self.incorrect_score)
        return params

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RewardConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"reward: unknown field(s) {unknown} (known: {sorted(known)})")
        if "sources" in d:
            if not isinstance(d["sources"], dict) or not d["sources"]:
                raise ValueError("reward.sources must be a non-empty mapping data_source -> spec")
            d["sources"] = {str(k): _spec(str(k), v) for k, v in d["sources"].items()}
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RewardConfig":
        """Reads a YAML file holding the reward section (or a recipe with a `reward:` key)."""
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
        try:
            return cls.from_dict(data.get("reward", data) if "reward" in data else data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


def _spec(name: str, value: Any) -> RewardSpec:
    if isinstance(value, str):
        return RewardSpec(fn=value)
    if not isinstance(value, dict):
        raise ValueError(f"reward.sources.{name}: expected a function name or a mapping, got {value!r}")
    known = {f.name for f in fields(RewardSpec)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"reward.sources.{name}: unknown field(s) {unknown} (known: {sorted(known)})")
    if "fn" not in value:
        raise ValueError(f"reward.sources.{name}: missing field 'fn'")
    if not isinstance(value.get("params", {}), dict):
        raise ValueError(f"reward.sources.{name}.params must be a mapping")
    return RewardSpec(**value)
