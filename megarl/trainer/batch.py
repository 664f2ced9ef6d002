"""A step's samples as one typed batch, and packed micro-batches that index into it.

`Trajectory` is what a rollout produces for one sample: plain values only (it is gathered across
ranks and checkpointed as is). `StepBatch` is built from a step's trajectories once and carries
everything computed about them as named fields: per-sample vectors [B] and response-aligned
per-token tensors [B, T] (row i, column j = response token j of sample i; T = the longest
response; columns past a response's end are 0). Prepare, advantages and updates read and write
those fields; nothing is keyed by strings.

A `MicroBatch` is a set of rows of the batch packed into one or more token rows for the model
(`build_microbatch`), plus `data`: those rows of the batch cut to the micro-batch's widest
response. Shift convention: for a sequence p_1..p_P r_1..r_R packed at offset o of its row, the
logits at position o+P-1+j predict response token j (0-based), so that token's log-prob, value
and loss live at position o+P-1+j.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megarl.data.packing import token_budget_microbatches


@dataclass
class Trajectory:
    """One sampled response as the rollout produced it (plain values; checkpointable)."""

    uid: str  # prompt group id
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float = 0.0  # shaped outcome reward (R + R_length)
    acc: bool = False  # correctness, used by dynamic sampling and the positive-example loss
    data_source: str = "math"
    policy_version: int = 0  # the training step whose weights generated it
    baseline_score: float | None = None  # ReMax: score of the greedy response to the same prompt

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def state(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class StepBatch:
    """The samples of one step (or a row subset of them). Per-sample fields are lists / [B]
    tensors; per-token fields are [B, T] float32 tensors, None until computed."""

    uid: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    finish_reason: list[str]
    data_source: list[str]
    score: torch.Tensor  # [B] float32: shaped outcome reward
    acc: torch.Tensor  # [B] bool
    policy_version: torch.Tensor  # [B] int64
    response_mask: torch.Tensor  # [B, T] 1.0 on real response tokens
    rollout_logprobs: torch.Tensor  # [B, T] engine log-probs (diagnostics, off-policy corrections)
    loss_mask: torch.Tensor | None = None  # tokens the policy loss counts (DAPO overlong filter)
    value_mask: torch.Tensor | None = None  # tokens the critic trains on (T-PPO: finished only)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # room for what other methods attach per token: MoE routing replay [B, T, layers, top_k],
    # PAG turn ids [B, T]; per-sample image inputs (VLM)
    routed_experts: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    images: list | None = None
    baseline_score: torch.Tensor | None = None  # [B] float32 ReMax baseline (greedy response's score)

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory]) -> "StepBatch":
        B, T = len(trajs), max([1] + [len(t.response_ids) for t in trajs])
        mask, rollout = torch.zeros(B, T), torch.zeros(B, T)
        for i, t in enumerate(trajs):
            R = len(t.response_ids)
            mask[i, :R] = 1.0
            if t.rollout_logprobs:
                rollout[i, :R] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        return cls(
            uid=[t.uid for t in trajs], prompt_ids=[list(t.prompt_ids) for t in trajs],
            response_ids=[list(t.response_ids) for t in trajs], finish_reason=[t.finish_reason for t in trajs],
            data_source=[t.data_source for t in trajs],
            score=torch.tensor([float(t.score) for t in trajs], dtype=torch.float32),
            acc=torch.tensor([bool(t.acc) for t in trajs], dtype=torch.bool),
            policy_version=torch.tensor([int(t.policy_version) for t in trajs], dtype=torch.int64),
            response_mask=mask, rollout_logprobs=rollout,
            baseline_score=(torch.tensor([float(t.baseline_score) for t in trajs], dtype=torch.float32)
                            if trajs and all(t.baseline_score is not None for t in trajs) else None),
        )

    def __len__(self) -> int:
        return len(self.uid)

    @property
    def width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def lengths(self) -> list[int]:
        """Prompt + response tokens per sample."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def truncated(self) -> torch.Tensor:
        """[B] bool: unfinished T-PPO samples (the window ended, not the response)."""
        return torch.tensor([f == "truncated" for f in self.finish_reason], dtype=torch.bool)

    def select(self, rows: list[int], width: int | None = None) -> "StepBatch":
        """These rows (in this order), per-token fields cut to `width` columns (default: all)."""
        idx = torch.tensor(rows, dtype=torch.long)
        w = self.width if width is None else width
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows]
            elif v.dim() == 1:
                out[f.name] = v[idx.to(v.device)]
            else:
                out[f.name] = v[idx.to(v.device), :w]
        return StepBatch(**out)

    def to(self, device) -> "StepBatch":
        """A copy whose tensors live on `device` (lists are shared)."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        })


@dataclass
class MicroBatch:
    rows: list[int]  # rows of the batch the micro-batch was built from
    data: StepBatch  # those rows, cut to the widest response of the micro-batch
    input_ids: torch.Tensor  # [rows, S]
    position_ids: torch.Tensor  # [rows, S]
    targets: torch.Tensor  # [rows, S] next token at every position
    resp_index: torch.Tensor  # [n, T_mb] flat (row * S + col) position of each response token
    cu_seqlens: torch.Tensor  # [n+1] int32 (padded) sequence boundaries of the single row (THD path)
    segments: list[list[int]] = field(default_factory=list)  # padded sequence lengths per row

    def attention_mask(self) -> torch.Tensor:
        """[rows, 1, S, S] bool block-causal mask (True = masked) for megatron's local attention.

        Built on demand (S^2 bytes per row): the THD path (Transformer Engine) never needs it."""
        n_rows, width = self.input_ids.shape
        mask = torch.ones(n_rows, 1, width, width, dtype=torch.bool, device=self.input_ids.device)
        mask[:, 0].diagonal(dim1=-2, dim2=-1).fill_(False)  # padding attends to itself only
        causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).triu(1)
        for r, lengths in enumerate(self.segments):
            off = 0
            for L in lengths:
                mask[r, 0, off : off + L, off : off + L] = causal[:L, :L]
                off += L
        return mask

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[rows, S] (any shape with rows*S elements) packed values -> [n, T_mb] response view
        (0 past each response's end)."""
        flat = per_position.reshape(-1)
        return flat[self.resp_index] * self.data.response_mask.to(flat.dtype)

    def to(self, device) -> "MicroBatch":
        return dataclasses.replace(
            self, data=self.data.to(device), input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device), targets=self.targets.to(device),
            resp_index=self.resp_index.to(device), cu_seqlens=self.cu_seqlens.to(device),
        )


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_microbatch(batch: StepBatch, rows: list[int], row_tokens: int | None = None,
                     pad_multiple: int = 1) -> MicroBatch:
    """Packs the sequences (prompt + response) of `rows` into token rows (host tensors).

    row_tokens=None: one row, sequences delimited by cu_seqlens (the THD path). With row_tokens,
    sequences are packed first-fit-decreasing into rows of at most that many tokens (a longer
    sequence gets a row of its own): the local attention's cost grows with the row length
    squared, so short rows keep it near the per-sequence cost. Every sequence is padded to a
    multiple of `pad_multiple` (sequence parallelism needs the row length divisible by TP, FP8 by
    16); the padding sits after the sequence inside its own causal block, so it changes nothing
    before it.
    """
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
    padded = [padded_length(len(s), pad_multiple) for s in seqs]
    if row_tokens is None:
        packing = [list(range(len(seqs)))]
    else:
        packing = [list(r) for r in token_budget_microbatches(padded, row_tokens)]
    width = max(sum(padded[i] for i in r) for r in packing)
    ids = torch.zeros(len(packing), width, dtype=torch.long)
    pos = torch.zeros(len(packing), width, dtype=torch.long)
    T = max(1, max(len(batch.response_ids[i]) for i in rows))
    resp_index = torch.zeros(len(rows), T, dtype=torch.long)
    segments: list[list[int]] = []
    starts = {}
    for r, members in enumerate(packing):
        off = 0
        for k in members:
            L = len(seqs[k])
            P, R = len(batch.prompt_ids[rows[k]]), len(batch.response_ids[rows[k]])
            ids[r, off : off + L] = torch.tensor(seqs[k])
            pos[r, off : off + padded[k]] = torch.arange(padded[k])
            resp_index[k, :R] = r * width + off + P - 1 + torch.arange(R)
            starts[k] = off
            off += padded[k]
        segments.append([padded[k] for k in members])
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    if row_tokens is None:  # one row: boundaries in packing order
        cu[1:] = torch.tensor([padded[k] for k in packing[0]]).cumsum(0)
    return MicroBatch(
        rows=list(rows), data=batch.select(list(rows), width=T), input_ids=ids, position_ids=pos,
        targets=torch.roll(ids, shifts=-1, dims=1),  # crosses sequence ends only at unused positions
        resp_index=resp_index, cu_seqlens=cu, segments=segments,
    )


def split_microbatches(batch: StepBatch, rows: list[int], max_tokens: int, row_tokens: int | None = None,
                       pad_multiple: int = 1) -> list[MicroBatch]:
    """Token-budget micro-batches (first-fit-decreasing over whole sequences) of these rows."""
    all_lengths = batch.lengths
    lengths = [padded_length(all_lengths[i], pad_multiple) for i in rows]
    groups = token_budget_microbatches(lengths, max_tokens)
    return [build_microbatch(batch, [rows[i] for i in g], row_tokens, pad_multiple) for g in groups]
