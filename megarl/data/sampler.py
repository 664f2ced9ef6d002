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

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the dataset size, seed and shuffle flag must match (batch size may change)."""
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
