"""Rollout batches and packed micro-batches for megatron-core forward/backward.

A `Trajectory` is one sampled response with everything computed about it. Micro-batches are
built by packing whole trajectories (prompt + response) into one row up to a token budget; the
loss function then gathers the response positions back into a padded [B_mb, T] view so that
the pure functions of megarl.algorithms apply unchanged.

Shift convention: for a sequence p_1..p_P r_1..r_R packed at offset o of its row, the logits at
position o+P-1+j predict response token j (0-based), so that token's log-prob, value and loss
live at position o+P-1+j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.data.packing import token_budget_microbatches


@dataclass
class Trajectory:
    uid: str  # prompt group id
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float = 0.0  # shaped outcome reward (R + R_length)
    acc: bool = False  # correctness, used by dynamic sampling and the positive-example loss
    data_source: str = "math"
    # filled by the trainer (1-D tensors of length len(response_ids))
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [rows, S]
    position_ids: torch.Tensor  # [rows, S]
    attention_mask: torch.Tensor  # [rows, 1, S, S] bool, True = masked (local attention)
    cu_seqlens: torch.Tensor  # [n+1] int32 sequence boundaries (TE THD path, one row)
    targets: torch.Tensor  # [rows, S] next token at every position
    resp_index: torch.Tensor  # [n, T] flat (row * S + col) position of each response token
    resp_mask: torch.Tensor  # [n, T] 1.0 for real response tokens
    trajectories: list[Trajectory]

    def padded(self, key: str) -> torch.Tensor:
        """[n, T] view of a per-token trajectory tensor (0 where padded)."""
        return response_tensor(self.trajectories, key)[0]

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[rows, S] (any shape with rows*S elements) packed values -> [n, T] response view."""
        flat = per_position.reshape(-1)
        return flat[self.resp_index] * self.resp_mask.to(flat.dtype)


def build_microbatch(trajs: list[Trajectory], row_tokens: int | None = None) -> MicroBatch:
    """Packs whole trajectories into rows.

    row_tokens=None: one row, sequences delimited by cu_seqlens (the TE THD path; also gets a
    block-causal mask for the local attention). With row_tokens, sequences are packed
    first-fit-decreasing into rows of at most that many tokens (a longer sequence gets a row of
    its own), each row with its own block-causal mask: the local attention's cost grows with the
    row length squared, so short rows keep it near the per-sequence cost.
    """
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    if row_tokens is None:
        rows = [list(range(len(seqs)))]
    else:
        rows = [list(r) for r in token_budget_microbatches([len(q) for q in seqs], row_tokens)]
    width = max(sum(len(seqs[i]) for i in r) for r in rows)
    n_rows = len(rows)
    ids = torch.zeros(n_rows, width, dtype=torch.long)
    pos = torch.zeros(n_rows, width, dtype=torch.long)
    mask = torch.ones(n_rows, 1, width, width, dtype=torch.bool)  # True = masked
    mask[:, 0].diagonal(dim1=-2, dim2=-1).fill_(False)  # padding attends to itself only
    T = max(1, max(len(t.response_ids) for t in trajs))
    resp_index = torch.zeros(len(trajs), T, dtype=torch.long)
    resp_mask = torch.zeros(len(trajs), T)
    lengths = []
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            L, P, R = len(seqs[i]), len(trajs[i].prompt_ids), len(trajs[i].response_ids)
            ids[r, off : off + L] = torch.tensor(seqs[i])
            pos[r, off : off + L] = torch.arange(L)
            mask[r, 0, off : off + L, off : off + L] = torch.ones(L, L, dtype=torch.bool).triu(1)
            resp_index[i, :R] = r * width + off + P - 1 + torch.arange(R)
            resp_mask[i, :R] = 1.0
            lengths.append(L)
            off += L
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        cu_seqlens=cu,
        targets=torch.roll(ids, shifts=-1, dims=1),  # crosses sequence ends only at unused positions
        resp_index=resp_index,
        resp_mask=resp_mask,
        trajectories=trajs,
    )


def response_tensor(trajs: list[Trajectory], key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads a per-token tensor of each trajectory to [B, T]; returns (values, mask)."""
    T = max(1, max(len(t.response_ids) for t in trajs))
    vals = torch.zeros(len(trajs), T)
    mask = torch.zeros(len(trajs), T)
    for i, t in enumerate(trajs):
        R = len(t.response_ids)
        if key:
            vals[i, :R] = t.tensors[key].float()
        mask[i, :R] = 1.0
    return vals, mask


def scatter_response_tensor(trajs: list[Trajectory], key: str, values: torch.Tensor) -> None:
    """Inverse of response_tensor: stores row i's first len(response) entries on trajectory i."""
    for i, t in enumerate(trajs):
        t.tensors[key] = values[i, : len(t.response_ids)].detach().clone()
