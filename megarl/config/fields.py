"""`doc_field`: a config dataclass field that carries its one-line doc (megarl.config.schema)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


def doc_field(default: Any, doc: str) -> Any:
    """A dataclass field with ``default`` and a doc string kept in ``metadata["doc"]``.

    Mutable defaults (list, dict, config dataclasses) are deep-copied per instance through ``default_factory``.
    """
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})
