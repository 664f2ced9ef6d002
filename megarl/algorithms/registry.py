"""Name -> function registries for the names used in configs.

`ADVANTAGES` (advantage estimators, uniform signature, see `estimators.py`), `POLICY_LOSSES`,
`LOSS_AGGS` (loss aggregation modes, see `losses.agg_loss`) and `KL_PENALTIES` (per-token KL
estimators). Looking up an unknown name raises `KeyError` naming the registry and listing the
valid names. Entries are added with the `register` decorator by the modules that define them;
importing `megarl.algorithms` imports all of them.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """A dict of name -> callable whose failed lookups list the valid names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __missing__(self, name):
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: registers the function under every name in `names`."""

        def deco(fn: F) -> F:
            for name in names:
                if name in self:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self[name] = fn
            return fn

        return deco


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGS = Registry("loss aggregation mode")
KL_PENALTIES = Registry("KL penalty kind")
