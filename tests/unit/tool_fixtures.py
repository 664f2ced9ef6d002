"""User tools named by dotted path in the tool tests (rollout.tools.functions)."""

import time

CALLS: list[tuple[str, dict]] = []


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    CALLS.append(("add", {"a": a, "b": b}))
    return a + b


def lookup(key):
    CALLS.append(("lookup", {"key": key}))
    return {"key": key, "value": len(str(key))}


def boom(x=None):
    raise RuntimeError("the tool crashed")


def slow(seconds: float = 30.0) -> str:
    time.sleep(seconds)
    return "done"


add_schema_free = lookup
