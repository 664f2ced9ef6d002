"""Sequence packing, token-budget micro-batches and DP load balancing (pure functions on lengths).

Packed layout (THD): n sequences are concatenated into one row of S = Σ len_i tokens.
``cu_seqlens = [0, len_0, len_0+len_1, ..., S]`` (int32); positions restart at 0 in every
sequence; attention is causal inside a sequence and blocked across sequences.

Shift convention (next-token prediction). In a packed sequence x_0..x_{L-1} (0-based, local to
the sequence) the logits at position t predict token x_{t+1}; the last position of every
sequence predicts nothing. For a prompt p_1..p_P followed by a response r_1..r_R (L = P + R),
r_j sits at local position P+j-1 and its log-prob comes from the logits at local position
**P+j-2**, for j = 1..R. So the response mask covers local positions P-1 .. P+R-2 (R positions;
the last prompt position P-1 predicts r_1, the last response position P+R-1 is excluded). In
packed coordinates add ``cu_seqlens[i]``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch


def _check_lengths(lengths: Sequence[int], what: str) -> None:
    for i, n in enumerate(lengths):
        if int(n) != n or n < 0:
            raise ValueError(f"{what}: length {i} is {n!r}; lengths must be non-negative ints")


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Partition sample indices into `dp_size` groups with near-equal token totals.

    Greedy LPT (longest processing time first): indices sorted by length descending (ties by
    index), each placed on the group with the least tokens (ties: fewer samples, then lower
    rank). Max group load <= 4/3 of optimal; deterministic. Groups are returned with indices
    ascending. Every group gets at least one sample when len(lengths) >= dp_size (an empty group
    always has the minimal load and count); sample counts may differ between groups.
    """
    if dp_size < 1:
        raise ValueError(f"balance_across_dp: dp_size must be >= 1, got {dp_size}")
    _check_lengths(lengths, "balance_across_dp")
    heap = [(0, 0, rank) for rank in range(dp_size)]  # (tokens, samples, rank)
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, rank = heapq.heappop(heap)
        groups[rank].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, rank))
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


@dataclass
class PackedBatch:
    """n sequences packed into one row; see the module doc for the layout and shift convention.

    input_ids, position_ids, labels: [1, S] int64; cu_seqlens: [n+1] int32.
    labels[t] = input_ids[t+1] inside a sequence and `label_fill` at each sequence's last position.
    With prompts/responses (`pack_prompt_response`): response_mask [1, S] bool is True exactly at
    the positions whose logits predict a response token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    labels: torch.Tensor
    prompt_lens: list[int] | None = None
    response_lens: list[int] | None = None
    response_mask: torch.Tensor | None = None

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def cu_seqlens_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return out


def pack_sequences(seqs: Sequence[Sequence[int]], label_fill: int = 0) -> PackedBatch:
    if not seqs:
        raise ValueError("pack_sequences: no sequences")
    lens = [len(s) for s in seqs]
    if min(lens) == 0:
        raise ValueError(f"pack_sequences: sequence {lens.index(0)} is empty")
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lens]).unsqueeze(0)
    cu = cu_seqlens_from_lengths(lens)
    return PackedBatch(input_ids, position_ids, cu, lens, max(lens),
                       next_token_labels(input_ids, cu, fill=label_fill))


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """labels[..., t] = input_ids[..., t+1] within a sequence; `fill` at each sequence's last token."""
    labels = torch.full_like(input_ids, fill)
    labels[..., :-1] = input_ids[..., 1:]
    ends = cu_seqlens[1:].long() - 1
    labels[..., ends] = fill
    return labels


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [1, 1, S, S], True = masked (Megatron convention: True means "do not attend").

    Query i may attend key j iff both lie in the same sequence and j <= i. O(S²) memory: for
    tests and small CPU runs; long sequences use THD kernels with cu_seqlens instead.
    """
    cu = cu_seqlens.long()
    seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    pos = torch.arange(int(cu[-1]))
    allowed = (seq_of[:, None] == seq_of[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split per-token `values` [S, ...] back into one tensor per sequence."""
    total = int(cu_seqlens[-1])
    if values.shape[0] != total:
        raise ValueError(f"unpack: values have {values.shape[0]} rows but cu_seqlens ends at {total}")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(values, lens, dim=0))


def _check_pr(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> None:
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        if p < 1 or r < 0:
            raise ValueError(f"sequence {i}: prompt length {p} must be >= 1 and response length {r} >= 0")


def response_logit_mask(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> torch.Tensor:
    """bool [S]: True at the packed positions whose logits predict a response token.

    Sequence i occupies [c_i, c_i + P_i + R_i); True on [c_i + P_i - 1, c_i + P_i + R_i - 1).
    """
    _check_pr(prompt_lens, response_lens)
    mask = torch.zeros(sum(prompt_lens) + sum(response_lens), dtype=torch.bool)
    start = 0
    for p, r in zip(prompt_lens, response_lens):
        mask[start + p - 1:start + p - 1 + r] = True
        start += p + r
    return mask


def pack_prompt_response(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         label_fill: int = 0) -> PackedBatch:
    """Pack prompt+response pairs; labels and response_mask follow the module's shift convention."""
    if len(prompts) != len(responses):
        raise ValueError(f"pack_prompt_response: {len(prompts)} prompts but {len(responses)} responses")
    packed = pack_sequences([list(p) + list(r) for p, r in zip(prompts, responses)], label_fill)
    packed.prompt_lens = [len(p) for p in prompts]
    packed.response_lens = [len(r) for r in responses]
    packed.response_mask = response_logit_mask(packed.prompt_lens, packed.response_lens).unsqueeze(0)
    return packed


def gather_response_values(values: torch.Tensor, prompt_lens: Sequence[int],
                           response_lens: Sequence[int]) -> list[torch.Tensor]:
    """Per-position `values` [S, ...] -> per response [R_i, ...]; entry j-1 belongs to r_j
    (taken from packed position c_i + P_i + j - 2, the logits that predict r_j)."""
    mask = response_logit_mask(prompt_lens, response_lens)
    if values.shape[0] != mask.shape[0]:
        raise ValueError(f"gather_response_values: values have {values.shape[0]} rows, lengths sum to {mask.shape[0]}")
    return list(torch.split(values[mask], list(response_lens), dim=0))


def scatter_response_values(per_response: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                            response_lens: Sequence[int], fill: float = 0.0) -> torch.Tensor:
    """Inverse of `gather_response_values`: per response [R_i, ...] -> packed [S, ...] placed at
    the positions that predict each response token, `fill` elsewhere."""
    mask = response_logit_mask(prompt_lens, response_lens)
    for i, (v, r) in enumerate(zip(per_response, response_lens)):
        if v.shape[0] != r:
            raise ValueError(f"scatter_response_values: response {i} has {v.shape[0]} values, length {r}")
    flat = torch.cat(list(per_response), dim=0)
    out = torch.full((mask.shape[0], *flat.shape[1:]), fill, dtype=flat.dtype)
    out[mask] = flat
    return out
