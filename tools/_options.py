"""`add_options`: the tools' plain `--name value` options, one keyword each (not a user tool)."""

from __future__ import annotations

import argparse
import json


def add_options(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Adds `--name` for every keyword (underscores become dashes), typed like its default."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return parser


def key_values(items: list[str] | None, option: str) -> dict:
    """`option`'s KEY=VALUE strings -> a dict; VALUE parsed as JSON when it is JSON (true, 0.3, "x")."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{option} {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
