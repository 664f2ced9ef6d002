"""The config's error type, shared by the loader and the validation (neither imports the other's module for it)."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """An invalid config: the message names each bad field (dotted path) and where it was set."""

    def __init__(self, errors: str | Sequence[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            super().__init__(self.errors[0])
        else:
            super().__init__(f"{len(self.errors)} config errors:\n  " + "\n  ".join(self.errors))
