"""Rollout batches and packed micro-batches for megatron-core forward/backward.

A `Trajectory` is one sampled response with everything computed about it. Micro-batches are
built by packing whole trajectories (prompt + response) into one row up to a token budget; the
loss function then gathers the response positions back into a padded [B_mb, T] view so that
the pure functions of megarl.algorithms apply unchanged.

Shift convention: for a sequence p_1..p_P r_1..r_R packed at offset o, the logits at packed
position o+P-1+j predict r_{j+1} (0-based j), so response token j's log-prob, value and loss
live at position o+P-1+j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.data.packing import block_causal_mask, pack_sequences


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
    input_ids: torch.Tensor  # [1, S]
    position_ids: torch.Tensor  # [1, S]
    attention_mask: torch.Tensor | None  # [1, 1, S, S] bool, True = masked (local spec)
    cu_seqlens: torch.Tensor  # [n+1] int32 (TE THD path)
    targets: torch.Tensor  # [1, S] next token at every position
    resp_index: torch.Tensor  # [n, T] packed position of each response token (0 where padded)
    resp_mask: torch.Tensor  # [n, T] 1.0 for real response tokens
    trajectories: list[Trajectory]

    def padded(self, key: str, dtype=torch.float32) -> torch.Tensor:
        """[n, T] view of a per-token trajectory tensor (0 where padded)."""
        out = torch.zeros(self.resp_mask.shape, dtype=dtype)
        for i, t in enumerate(self.trajectories):
            v = t.tensors[key]
            out[i, : v.numel()] = v.to(dtype)
        return out

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, S] (or [S]) packed values -> [n, T] response view (0 where padded)."""
        flat = per_position.reshape(-1)
        return flat[self.resp_index] * self.resp_mask.to(flat.dtype)


def build_microbatch(trajs: list[Trajectory], with_mask: bool = True) -> MicroBatch:
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    packed = pack_sequences(seqs)
    ids = packed.input_ids
    targets = torch.roll(ids, shifts=-1, dims=1)  # crosses sequence ends only at unused positions
    T = max(1, max(len(t.response_ids) for t in trajs))
    resp_index = torch.zeros(len(trajs), T, dtype=torch.long)
    resp_mask = torch.zeros(len(trajs), T)
    for i, t in enumerate(trajs):
        start = int(packed.cu_seqlens[i]) + len(t.prompt_ids) - 1
        R = len(t.response_ids)
        resp_index[i, :R] = torch.arange(start, start + R)
        resp_mask[i, :R] = 1.0
    return MicroBatch(
        input_ids=ids,
        position_ids=packed.position_ids,
        attention_mask=block_causal_mask(packed.cu_seqlens) if with_mask else None,
        cu_seqlens=packed.cu_seqlens,
        targets=targets,
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
