"""`KernelChoice`: which kernel a family of layers uses in this process ("auto": the layer's own
selection), set for good (`use`) or within a block (`forced`). The attention and the gated
delta-net kernels each keep one (`attention_kernels`, `gdn_kernels`)."""

from __future__ import annotations

import contextlib


class KernelChoice:
    def __init__(self, what: str, names: tuple[str, ...]):
        self.what, self.names, self.name = what, names, "auto"

    def _check(self, name: str) -> None:
        if name not in self.names:
            raise ValueError(f"unknown {self.what} {name!r} (choose from {', '.join(self.names)})")

    def use(self, name: str) -> None:
        self._check(name)
        self.name = name

    @contextlib.contextmanager
    def forced(self, name: str):
        self._check(name)
        before, self.name = self.name, name
        try:
            yield
        finally:
            self.name = before
