"""Names in configs -> code: one registry mechanism, and user code by dotted path through the same door.

Every table of names megarl reads from a config is a `Registry`: the advantage estimators, policy
losses, loss aggregations and KL penalties (`megarl.algorithms.registry`), reward functions
(`megarl.rewards.registry`), rollout engines (`megarl.rollout.registry`), the model families of
the Megatron builder (`megarl.models.families`) and of the builtin engine
(`megarl.rollout.engine_families`), and the quickstart tasks (`megarl.tasks`). Modules add their
entries with the `register` decorator when they are imported.

Wherever a config takes a registered name it also takes `package.module:function` (user code):
`Registry.resolve` takes both, and a failed lookup names the registry, the config field and the
valid names.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable)


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


class Registry(dict):
    """A dict of name -> object whose failed lookups list the valid names.

    lazy_package: a name missing at lookup is first looked for in the module
    `<lazy_package>.<name>`, which registers it when imported (entries that live in optional
    modules, e.g. one module per quickstart task)."""

    def __init__(self, kind: str, lazy_package: str | None = None):
        super().__init__()
        self.kind = kind
        self.lazy_package = lazy_package

    def __missing__(self, name):
        if self.lazy_package and isinstance(name, str) and name.isidentifier():
            try:
                importlib.import_module(f"{self.lazy_package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{self.lazy_package}.{name}":
                    raise
            if dict.__contains__(self, name):
                return dict.__getitem__(self, name)
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: registers the object under every name in `names`."""

        def deco(obj: F) -> F:
            for name in names:
                if name in self:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self[name] = obj
            return obj

        return deco

    def resolve(self, name: str, where: str = "config"):
        """The entry `name`, or user code when `name` is a dotted path (`where`: the config field,
        named in the error)."""
        return import_object(name, where) if is_dotted_path(name) else self[name]
