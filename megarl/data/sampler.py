"""Deterministic, resumable prompt sampler.

Epoch e visits the items in the order of ``random.Random(seed + e).shuffle(range(N))`` (identity
order without shuffle). Batches are consecutive slices of that order; a batch that crosses the
end of an epoch is completed from the start of the next epoch's order. The state is just
``(epoch, position)`` plus the identity of the setup, so resuming reproduces the exact stream.
"""

from __future__ import annotations

import random
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


class PromptSampler:
    def __init__(self, dataset: Sequence[Any], batch_prompts: int, seed: int, shuffle: bool = True):
        if batch_prompts < 1:
            raise ValueError(f"PromptSampler: batch_prompts must be >= 1, got {batch_prompts}")
        if len(dataset) == 0:
            raise ValueError("PromptSampler: the dataset is empty")
        if batch_prompts > len(dataset):
            raise ValueError(f"PromptSampler: batch_prompts={batch_prompts} exceeds the dataset size "
                             f"{len(dataset)}; one batch would repeat prompts")
        self.dataset, self.batch_prompts, self.seed, self.shuffle = dataset, batch_prompts, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, []

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def next_batch(self) -> list[Any]:
        batch = []
        while len(batch) < self.batch_prompts:
            order = self.epoch_order(self.epoch)
            take = min(self.batch_prompts - len(batch), len(order) - self.position)
            batch += [self.dataset[i] for i in order[self.position:self.position + take]]
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def set_step(self, step: int) -> None:
        """The plain stream does not depend on the training step (see SourceScheduleSampler)."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the dataset size, seed and shuffle flag must match (batch size may change)."""
        if "epoch" not in state:
            raise ValueError("PromptSampler.load_state_dict: the checkpoint's prompt stream was written by "
                             "another sampler (data.first_sources set then, not now?)")
        for key, mine in (("dataset_size", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"PromptSampler.load_state_dict: {key}={state[key]!r} in the saved state "
                                 f"but {mine!r} now; resuming would not reproduce the prompt stream")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise ValueError(f"PromptSampler.load_state_dict: invalid epoch/position {epoch}/{position} "
                             f"for a dataset of {len(self.dataset)}")
        self.epoch, self.position = epoch, position


def shard_for_rank(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Contiguous shard ``rank`` of ``world_size`` (sizes differ by at most one, lower ranks larger)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_for_rank: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    base, rem = divmod(len(items), world_size)
    start = rank * base + min(rank, rem)
    return list(items[start:start + base + (rank < rem)])


def first_sources_share(step: int, natural: float, steps: int, decay: str) -> float:
    """Share of the first-trained data sources in the batch at `step` (docs/algorithms.md §7: math and
    code prompts first, then the others mixed in; the schedule is not stated [NS->C]):

        "step":   1 for step < steps, then `natural` (their share of the dataset)
        "linear": 1 - (1 - natural) * min(1, step / steps)
    """
    if decay not in ("step", "linear"):
        raise ValueError(f"first_sources_share: decay must be 'step' or 'linear', got {decay!r}")
    if steps <= 0:
        return natural
    if decay == "step":
        return 1.0 if step < steps else natural
    return 1.0 - (1.0 - natural) * min(1.0, step / steps)


class SourceScheduleSampler:
    """Prompts of `first_sources` first (data.first_sources), then the natural mix.

    Two `PromptSampler` streams, over the first sources' items and over the rest (seeds `seed`
    and `seed + 1`); the batch at step s takes round(B * first_sources_share(s)) prompts from
    the first stream and the others from the rest, first-stream prompts first. After the
    schedule the batches are stratified at the natural share. `set_step` is called once per
    training step; the state is both streams' states, so resuming reproduces the stream. A
    stream asked for more prompts than it holds wraps into its next epoch (prompts repeat).
    """

    def __init__(self, dataset: Sequence[Any], batch_prompts: int, seed: int, shuffle: bool,
                 first_sources: Sequence[str], steps: int, decay: str):
        first = [x for x in dataset if x.data_source in first_sources]
        rest = [x for x in dataset if x.data_source not in first_sources]
        if not first or not rest:
            sources = sorted({x.data_source for x in dataset})
            raise ValueError(f"data.first_sources={list(first_sources)}: the training set's data sources are "
                             f"{sources}; the schedule needs rows both in and outside the first sources")
        first_sources_share(0, 0.0, steps, decay)  # validates decay
        self.dataset, self.batch_prompts = dataset, batch_prompts
        self.natural, self.steps, self.decay, self.step = len(first) / len(dataset), steps, decay, 0
        self.first = PromptSampler(first, 1, seed, shuffle)
        self.rest = PromptSampler(rest, 1, seed + 1, shuffle)

    def set_step(self, step: int) -> None:
        self.step = step

    def next_batch(self) -> list[Any]:
        n_first = round(self.batch_prompts * first_sources_share(self.step, self.natural, self.steps, self.decay))
        out = []
        for stream, n in ((self.first, n_first), (self.rest, self.batch_prompts - n_first)):
            if n:
                stream.batch_prompts = n
                out += stream.next_batch()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"first": self.first.state_dict(), "rest": self.rest.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"first", "rest"}:
            raise ValueError("SourceScheduleSampler.load_state_dict: the checkpoint was written without "
                             "data.first_sources (or with another sampler); resuming would not reproduce the stream")
        self.first.load_state_dict(state["first"])
        self.rest.load_state_dict(state["rest"])
