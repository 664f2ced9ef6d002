"""User code named in a config by dotted path: `package.module:function`.

Reward functions (`reward.sources: {mydomain: mypkg.rewards:score}`), advantage estimators
(`algorithm.advantage: mypkg.adv:estimate`) and rollout functions (`rollout.function:
mypkg.rollout:collect`) accept such a path wherever a registry name is accepted.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def is_dotted_path(name: str) -> bool:
    return isinstance(name, str) and ":" in name


def import_object(path: str, where: str = "config") -> Callable:
    """The object `module:attr` names (attr may be dotted); a clear error naming `where` otherwise."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{where}: {path!r} is not a dotted path of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import module {module_name!r} of {path!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r} ({path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {path!r} is not callable")
    return obj


def resolve(name: str, registry: Mapping[str, Callable], where: str = "config") -> Callable:
    """A registry entry by name, or user code by dotted path."""
    return import_object(name, where) if is_dotted_path(name) else registry[name]
