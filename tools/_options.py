"""`add_options`: the tools' plain `--name value` options, one keyword each (not a user tool)."""

from __future__ import annotations

import argparse


def add_options(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Adds `--name` for every keyword (underscores become dashes), typed like its default."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return parser
