"""Name -> function registries for the names used in configs.

`ADVANTAGES` (advantage estimators, uniform signature, see `estimators.py`), `POLICY_LOSSES`,
`LOSS_AGGS` (loss aggregation modes, see `losses.agg_loss`) and `KL_PENALTIES` (per-token KL
estimators), all `megarl.registry.Registry`: looking up an unknown name raises `KeyError` naming
the registry and listing the valid names. Entries are added with the `register` decorator by the
modules that define them; importing `megarl.algorithms` imports all of them.
"""

from __future__ import annotations

from megarl.registry import Registry

ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGS = Registry("loss aggregation mode")
KL_PENALTIES = Registry("KL penalty kind")
