"""Token-budget micro-batches and DP load balancing (pure functions on sequence lengths).

The packed layout itself (THD rows, the response shift convention, CP chunks) is built by
`megarl.trainer.batch.build_microbatch`.
"""

from __future__ import annotations

import heapq
from typing import Sequence



def _check_lengths(lengths: Sequence[int], what: str) -> None:
    for i, n in enumerate(lengths):
        if int(n) != n or n < 0:
            raise ValueError(f"{what}: length {i} is {n!r}; lengths must be non-negative ints")


def balance_across_dp(lengths: Sequence[int], dp_size: int, home: Sequence[int] | None = None) -> list[list[int]]:
    """Partition sample indices into `dp_size` groups with near-equal token totals.

    Greedy LPT (longest processing time first): indices sorted by length descending (ties by
    index), each placed on the group with the least tokens (ties: fewer samples, then lower
    rank). Max group load <= 4/3 of optimal; deterministic. Groups are returned with indices
    ascending. Every group gets at least one sample when len(lengths) >= dp_size (an empty group
    always has the minimal load and count); sample counts may differ between groups.

    `home` (a preferred group per sample: where its data already is): the same order, but a
    sample stays on its home group while that group's tokens stay within LPT's largest group
    load; otherwise it goes where LPT would put it. The largest load is then LPT's in most
    batches (and never more than the least-loaded group's + the sample's), and most samples
    stay home. A group may then be empty.
    """
    if dp_size < 1:
        raise ValueError(f"balance_across_dp: dp_size must be >= 1, got {dp_size}")
    _check_lengths(lengths, "balance_across_dp")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, 0, rank) for rank in range(dp_size)]  # (tokens, samples, rank)
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        tokens, count, rank = heapq.heappop(heap)
        groups[rank].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, rank))
    if home is None:
        return [sorted(g) for g in groups]
    if len(home) != len(lengths) or any(not 0 <= h < dp_size for h in home):
        raise ValueError(f"balance_across_dp: home must give a group in [0, {dp_size}) for each of the "
                         f"{len(lengths)} samples")
    cap = max(sum(lengths[i] for i in g) for g in groups)
    loads, counts = [0] * dp_size, [0] * dp_size
    groups = [[] for _ in range(dp_size)]
    for i in order:
        rank = home[i]
        if loads[rank] + lengths[i] > cap:
            rank = min(range(dp_size), key=lambda r: (loads[r], counts[r], r))
        groups[rank].append(i)
        loads[rank] += lengths[i]
        counts[rank] += 1
    return [sorted(g) for g in groups]


class MicroBatches(list):
    """`list[list[int]]` of micro-batches plus ``oversized``: indices of single sequences longer
    than the token budget, each of which got a micro-batch of its own."""

    oversized: list[int]


def token_budget_microbatches(lengths: Sequence[int], max_tokens: int) -> MicroBatches:
    """Group indices into micro-batches of at most `max_tokens` tokens, first-fit-decreasing.

    Indices sorted by length descending (ties by index) go into the first micro-batch with room,
    else open a new one. A sequence longer than `max_tokens` cannot fit anywhere: it becomes a
    micro-batch of its own and is listed in ``result.oversized`` (the caller decides whether
    that is an error). Micro-batches are in opening order, each with indices ascending.
    """
    if max_tokens < 1:
        raise ValueError(f"token_budget_microbatches: max_tokens must be >= 1, got {max_tokens}")
    _check_lengths(lengths, "token_budget_microbatches")
    bins: list[list[int]] = []
    loads: list[int] = []
    oversized: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > max_tokens:
            oversized.append(i)
            bins.append([i])
            loads.append(max_tokens + 1)  # closed
            continue
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    out = MicroBatches(sorted(b) for b in bins)
    out.oversized = sorted(oversized)
    return out
