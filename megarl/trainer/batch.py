"""A step's samples as one typed batch, and packed micro-batches that index into it.

`Trajectory` is what a rollout produces for one sample: plain values only (it is gathered across
ranks and checkpointed as is). `StepBatch` is built from a step's trajectories once and carries
everything computed about them as named fields: per-sample vectors [B] and response-aligned
per-token tensors [B, T] (row i, column j = response token j of sample i; T = the longest
response; columns past a response's end are 0). Prepare, advantages and updates read and write
those fields; nothing is keyed by strings.

A `MicroBatch` is a set of rows of the batch packed into one token row for the model (THD,
`build_microbatch`; under context parallelism each rank keeps its chunks, `cp_shard`), plus `data`: those rows of the batch cut to the micro-batch's widest
response. Shift convention: for a sequence p_1..p_P r_1..r_R packed at offset o of its row, the
logits at position o+P-1+j predict response token j (0-based), so that token's log-prob, value
and loss live at position o+P-1+j.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from megarl.algorithms.tppo import window_mask
from megarl.data.packing import token_budget_microbatches
from megarl.trainer import vocab_parallel
from megarl.trainer.vision_batch import images_of, packed_vision


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
    policy_version: int = 0  # the training step whose weights generated it (T-PPO: its latest window)
    baseline_score: float | None = None  # ReMax: score of the greedy response to the same prompt
    window_start: int = 0  # T-PPO: response index of the first token of the latest window
    start_version: int | None = None  # T-PPO: policy version of the first window (None: policy_version)
    # MoE routing replay: experts the engine's routers selected, [prompt + response tokens, layers,
    # top_k] (megarl.rollout.torch_moe.sample_routing; the trainer's copy holds only its pipeline
    # stage's MoE layers, uint8 where the experts fit: megarl.trainer.rows); None when not recorded
    routed_experts: torch.Tensor | None = None
    # PAG multi-turn trajectory (megarl/rollout/multi_turn.py); None for single-turn samples.
    # template_mask: per response token 1 = appended instruction (no loss, no value), 0 = generated;
    # per turn k: turn_ends (response index of its last token), turn_is_policy (solution / verifier),
    # turn_outcome (policy turn: answer correct 1 / 0; verifier turn: verdict 1 correct, 0 wrong, -1 missing)
    template_mask: list[int] | None = None
    turn_ends: list[int] | None = None
    turn_is_policy: list[bool] | None = None
    turn_outcome: list[int] | None = None
    # vision-language models: the prompt's images as the engine saw them (PromptImages' tensors)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    videos: dict | None = None  # its videos: PromptImages.video_fields() (megarl.trainer.vision_batch)
    # tool-calling rollouts (megarl/trainer/tools.py): template_mask marks the observation tokens (no
    # turn layout); tool_stats: the trajectory's turns, calls per tool, errors, how it ended
    tool_stats: dict | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def first_version(self) -> int:
        return self.policy_version if self.start_version is None else self.start_version

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
    # MoE routing replay: per sample the engine's experts [prompt + response tokens, layers, top_k]
    routed_experts: list[torch.Tensor] | None = None
    turn_ids: torch.Tensor | None = None  # room for what other methods attach per token (PAG turn ids)
    images: list | None = None  # vision-language models: per sample its PromptImages or None
    baseline_score: torch.Tensor | None = None  # [B] float32 ReMax baseline (greedy response's score)
    window_start: torch.Tensor | None = None  # [B] int64 first response index of the latest window (T-PPO)
    start_version: torch.Tensor | None = None  # [B] int64 policy version of the first window (T-PPO)
    is_weights: torch.Tensor | None = None  # [B, T] rollout IS weights (algorithm.rollout_is)
    # PAG (Trajectory's fields of the same names): [B, T] 1.0 on template tokens (also tool observations,
    # which have no turn lists); per-sample turn lists
    template_mask: torch.Tensor | None = None
    turn_ends: list[list[int]] | None = None
    turn_is_policy: list[list[bool]] | None = None
    turn_outcome: list[list[int]] | None = None
    prm_rewards: torch.Tensor | None = None  # [B, T] code PRM dense line rewards (prm.dense_reward)

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
            window_start=torch.tensor([int(t.window_start) for t in trajs], dtype=torch.int64),
            start_version=torch.tensor([int(t.first_version) for t in trajs], dtype=torch.int64),
            routed_experts=([t.routed_experts for t in trajs]
                            if trajs and all(t.routed_experts is not None for t in trajs) else None),
            images=([images_of(t) for t in trajs] if any(t.pixel_values is not None or t.videos for t in trajs)
                    else None),
            **_turn_fields(trajs, T),
        )

    def __len__(self) -> int:
        return len(self.uid)

    @property
    def width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] response tokens per sample."""
        return self.response_mask.sum(-1)

    @property
    def lengths(self) -> list[int]:
        """Prompt + response tokens per sample."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def truncated(self) -> torch.Tensor:
        """[B] bool: unfinished T-PPO samples (the window ended, not the response)."""
        return torch.tensor([f == "truncated" for f in self.finish_reason], dtype=torch.bool)

    @property
    def window_mask(self) -> torch.Tensor:
        """[B, T] the tokens of each sample's latest window (all response tokens without windows)."""
        if self.window_start is None:
            return self.response_mask
        return window_mask(self.response_mask, self.window_start)

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
            f.name: to_device(getattr(self, f.name), device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        })


def to_device(t: torch.Tensor | None, device) -> torch.Tensor | None:
    """`t` on `device`. A host tensor bound for a GPU goes through pinned memory without blocking:
    a copy from pageable memory would first wait for every kernel queued on the stream, so the
    host could never prepare the next micro-batch while the GPU works on this one."""
    if t is None:
        return None
    if t.device.type == "cpu" and torch.device(device).type == "cuda" and torch.cuda.is_available():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class MicroBatch:
    rows: list[int]  # rows of the batch the micro-batch was built from
    data: StepBatch  # those rows, cut to the widest response of the micro-batch
    input_ids: torch.Tensor  # [1, S] the packed sequences (this CP rank's tokens after cp_shard)
    position_ids: torch.Tensor  # [1, S] position within each sequence ([3, 1, S] M-RoPE ids with images)
    targets: torch.Tensor  # [1, S] next token at every position of the full row
    resp_index: torch.Tensor  # [n, T_mb] position in the full row of each response token
    owner: torch.Tensor  # [n, T_mb] position in input_ids of each response token; -1: not here
    cu_seqlens: torch.Tensor  # [n+1] int32 padded sequence boundaries of the full row
    cp_size: int = 1
    chunk_tokens: int = 4096  # log-probs / entropy are computed over this many tokens at a time
    # MoE routing replay: [S, layers, top_k] the engine's experts at every position of input_ids,
    # and [S] bool the positions the engine forwarded (not padding, not a sequence's last token)
    routed_experts: torch.Tensor | None = None
    routing_valid: torch.Tensor | None = None
    # vision-language models (`vision_batch.packed_vision`): [1, S] which tokens are image / video
    # placeholders, and the images / videos of the packed sequences in order (position_ids are then
    # M-RoPE ids [3, 1, S]); the grids stay on the host (the tower reads them as Python ints)
    image_mask: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    video_mask: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    # set by `to`: owner[owner >= 0] (where in input_ids each held response token is) and
    # resp_index[owner >= 0] (its position in the full row)
    held_index: torch.Tensor | None = None
    held_pos: torch.Tensor | None = None
    padding: bool = False  # TrainModel.padding_microbatch: runs forward and backward, trains nothing

    @property
    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """The model's image keyword arguments (none for a text model)."""
        if self.image_mask is None:
            return {}
        out = {"image_mask": self.image_mask, "pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}
        if self.video_mask is not None:
            out.update(video_mask=self.video_mask, pixel_values_videos=self.pixel_values_videos,
                       video_grid_thw=self.video_grid_thw)
        return out

    def cp_shard(self, cp_rank: int, cp_size: int) -> "MicroBatch":
        """This CP rank's tokens: chunks r and 2*cp-1-r of every sequence (megarl.models.attention);
        the response tokens it does not hold get owner -1."""
        from megarl.models.attention import cp_shard_index

        mine = cp_shard_index(self.cu_seqlens.tolist(), cp_size, cp_rank)
        local = torch.full((self.input_ids.shape[1],), -1, dtype=torch.long)
        local[mine] = torch.arange(mine.numel())
        owner = torch.where(self.owner >= 0, local[self.resp_index], self.owner)
        routing = {}
        if self.routed_experts is not None:
            routing = dict(routed_experts=self.routed_experts[mine], routing_valid=self.routing_valid[mine])
        if self.image_mask is not None:
            routing["image_mask"] = self.image_mask[:, mine]
        if self.video_mask is not None:
            routing["video_mask"] = self.video_mask[:, mine]
        return dataclasses.replace(self, input_ids=self.input_ids[:, mine], position_ids=self.position_ids[..., mine],
                                   owner=owner, cp_size=cp_size, held_index=None, held_pos=None, **routing)

    def log_probs(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """[n, T_mb] log-probs of the response tokens from this rank's (vocab-parallel) logits."""
        return self._response_view(logits, lambda x, t: vocab_parallel.token_log_probs(x, t, temperature),
                                   self.targets.reshape(-1))

    def entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """[n, T_mb] entropy of the policy at every response token."""
        return self._response_view(logits, lambda x, _: vocab_parallel.entropy(x, temperature))

    def values(self, values: torch.Tensor) -> torch.Tensor:
        """[n, T_mb] critic values at the response tokens."""
        return self._response_view(values, lambda x, _: x[:, 0].float())

    def _response_view(self, out: torch.Tensor, fn, row_targets: torch.Tensor | None = None) -> torch.Tensor:
        """fn(rows of `out` at the response tokens held here, their targets from `row_targets`
        [S_full]), `chunk_tokens` rows at a time (with gradients, each chunk is recomputed in the
        backward: the float32 [tokens, vocab/tp] intermediates never exist for more than one
        chunk); then summed over CP, where every token is held by exactly one rank."""
        flat = out.reshape(-1, out.shape[-1])
        held = self.owner >= 0
        index, pos = (self.owner[held], self.resp_index[held]) if self.held_index is None \
            else (self.held_index, self.held_pos)
        tgt = row_targets[pos] if row_targets is not None else index
        parts = []
        for i in range(0, index.numel(), self.chunk_tokens):
            idx, t = index[i : i + self.chunk_tokens], tgt[i : i + self.chunk_tokens]
            if torch.is_grad_enabled() and flat.requires_grad:
                parts.append(checkpoint(lambda f, j, tt: fn(f[j], tt), flat, idx, t, use_reentrant=False,
                                        determinism_check="none"))  # strict device mode re-tags devices
            else:
                parts.append(fn(flat[idx], t))
        vals = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
        view = torch.zeros(held.shape, dtype=vals.dtype, device=vals.device).masked_scatter(held, vals)
        if self.cp_size > 1:
            from megatron.core import parallel_state as ps

            view = vocab_parallel.AllReduceSum.apply(view, ps.get_context_parallel_group())
        return view * self.data.response_mask.to(view.dtype)

    def to(self, device) -> "MicroBatch":
        """A copy on `device`; the response tokens this rank holds are located on the host first
        (`held_index` / `held_pos`), so the loss never waits on a device-side boolean index."""
        held = self.owner >= 0
        held_index, held_pos = (self.owner[held], self.resp_index[held]) if self.held_index is None \
            else (self.held_index, self.held_pos)
        moved = {name: to_device(getattr(self, name), device) for name in (
            "input_ids", "position_ids", "targets", "resp_index", "owner", "cu_seqlens", "routed_experts",
            "routing_valid", "pixel_values", "image_mask", "pixel_values_videos", "video_mask")}
        return dataclasses.replace(self, data=self.data.to(device), held_index=to_device(held_index, device),
                                   held_pos=to_device(held_pos, device), **moved)


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class TokenLayout:
    """How the trainer splits one packed row over ranks, and what every rank's part must divide by.

    With context parallelism (cp > 1) each sequence is cut into 2*cp equal chunks and CP rank r
    keeps chunks r and 2*cp-1-r (`MicroBatch.cp_shard`): every sequence length must divide by 2*cp,
    and each CP rank then holds row/cp tokens. Sequence parallelism cuts that share into `sp`
    contiguous equal parts (one per TP rank; 1 without it), whatever the sequence boundaries.
    Each of those parts must be a multiple of `align` (the FP8 GEMMs' token alignment; 1 = none).
    So only the row total needs more than 2*cp: `row_multiple`.
    """

    cp: int = 1
    sp: int = 1
    align: int = 1

    @property
    def sequence_multiple(self) -> int:
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def row_multiple(self) -> int:
        return math.lcm(self.sequence_multiple, self.cp * self.sp * self.align)

    def local_tokens(self, cu_seqlens: list[int]) -> list[int]:
        """Tokens of every (CP rank, SP rank) part of a row with these sequence boundaries, CP rank
        major; ValueError when the row does not split evenly."""
        from megarl.models.attention import cp_shard_index

        shares = ([len(cp_shard_index(cu_seqlens, self.cp, r)) for r in range(self.cp)]
                  if self.cp > 1 else [int(cu_seqlens[-1])])
        if any(n % self.sp for n in shares):
            raise ValueError(f"CP shares of {shares} tokens do not split over {self.sp} sequence-parallel ranks")
        return [n // self.sp for n in shares for _ in range(self.sp)]

    def check(self, cu_seqlens: list[int]) -> None:
        """The contract of a packed row: every rank's part is a multiple of `align` tokens."""
        parts = self.local_tokens(cu_seqlens)
        bad = sorted({n for n in parts if n % self.align})
        if bad:
            raise ValueError(f"a packed row of {cu_seqlens[-1]} tokens leaves {bad} tokens on some rank (cp={self.cp}, "
                             f"sp={self.sp}); every rank's part must be a multiple of {self.align} (FP8 alignment)")


def _turn_fields(trajs: list[Trajectory], T: int) -> dict:
    """StepBatch's PAG fields when every trajectory has a turn layout (multi-turn), else none; the
    template mask alone when every trajectory has one without a turn layout (tool observations)."""
    turns = bool(trajs) and all(t.turn_ends is not None for t in trajs)
    if not trajs or not (turns or all(t.template_mask is not None for t in trajs)):
        return {}
    template = torch.zeros(len(trajs), T)
    for i, t in enumerate(trajs):
        if t.template_mask:
            template[i, : len(t.template_mask)] = torch.tensor(t.template_mask, dtype=torch.float32)
    if not turns:
        return dict(template_mask=template)
    return dict(template_mask=template, turn_ends=[list(t.turn_ends) for t in trajs],
                turn_is_policy=[list(t.turn_is_policy) for t in trajs], turn_outcome=[list(t.turn_outcome) for t in trajs])


def build_microbatch(batch: StepBatch, rows: list[int], pad_multiple: int = 1, chunk_tokens: int = 4096,
                     vision=None, row_multiple: int = 1) -> MicroBatch:
    """Packs the sequences (prompt + response) of `rows` into one row delimited by cu_seqlens (THD;
    host tensors). Every sequence is padded to a multiple of `pad_multiple` (2*CP for context
    parallelism), then the last one further so the row is a multiple of `row_multiple` too
    (sequence parallelism and FP8: `TokenLayout`); the padding sits after its sequence inside that
    sequence's causal block, so it changes nothing before it. For a vision-language model (`vision`:
    its VisionSpec) the row also carries the image / video inputs (`vision_batch.packed_vision`).
    """
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
    padded = [padded_length(len(s), pad_multiple) for s in seqs]
    padded[-1] += padded_length(sum(padded), math.lcm(row_multiple, pad_multiple)) - sum(padded)
    width = sum(padded)
    ids = torch.zeros(1, width, dtype=torch.long)
    pos = torch.zeros(1, width, dtype=torch.long)
    T = max(1, max(len(batch.response_ids[i]) for i in rows))
    resp_index = torch.zeros(len(rows), T, dtype=torch.long)
    owner = torch.full((len(rows), T), -1, dtype=torch.long)
    off = 0
    for k, seq in enumerate(seqs):
        P, R = len(batch.prompt_ids[rows[k]]), len(batch.response_ids[rows[k]])
        ids[0, off : off + len(seq)] = torch.tensor(seq)
        pos[0, off : off + padded[k]] = torch.arange(padded[k])
        resp_index[k, :R] = off + P - 1 + torch.arange(R)
        owner[k, :R] = resp_index[k, :R]
        off += padded[k]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(padded).cumsum(0)
    routing = packed_routing(batch, rows, padded) if batch.routed_experts is not None else {}
    images = packed_vision(batch, rows, padded, vision) if vision is not None else {}
    pos = images.pop("position_ids", pos)
    return MicroBatch(
        rows=list(rows), data=batch.select(list(rows), width=T), input_ids=ids, position_ids=pos,
        targets=torch.roll(ids, shifts=-1, dims=1),  # crosses sequence ends only at unused positions
        resp_index=resp_index, owner=owner, cu_seqlens=cu, chunk_tokens=chunk_tokens, **routing, **images,
    )


def packed_routing(batch: StepBatch, rows: list[int], padded: list[int]) -> dict[str, torch.Tensor]:
    """The engine's experts laid out like the packed row: sequence k's tokens at its offset,
    padding given experts 0..top_k-1 (its routing only feeds the padding's own outputs, which
    nothing reads); valid = the tokens the engine forwarded (every token but a sequence's last)."""
    first = batch.routed_experts[rows[0]]
    layers, k = first.shape[1], first.shape[2]
    routed = torch.arange(k, dtype=first.dtype).expand(sum(padded), layers, k).clone()
    valid = torch.zeros(sum(padded), dtype=torch.bool)
    off = 0
    for i, width in zip(rows, padded):
        n = len(batch.prompt_ids[i]) + len(batch.response_ids[i])
        r = batch.routed_experts[i]
        if r.shape[0] != n:
            raise ValueError(f"sample {i}: routed_experts covers {r.shape[0]} tokens, the sequence has {n}")
        routed[off : off + n] = r.to(first.dtype)
        valid[off : off + n - 1] = True
        off += width
    return {"routed_experts": routed, "routing_valid": valid}


def split_microbatches(batch: StepBatch, rows: list[int], max_tokens: int, layout: TokenLayout = TokenLayout(),
                       chunk_tokens: int = 4096, vision=None) -> list[MicroBatch]:
    """Token-budget micro-batches (first-fit-decreasing over whole sequences) of these rows, packed
    for `layout`. The budget is rounded down to the row multiple, so the row padding stays within
    `max_tokens` (a longer single sequence gets a row of its own). Every row is checked against the
    layout (`TokenLayout.check`) before it leaves here."""
    all_lengths = batch.lengths
    seq_m, row_m = layout.sequence_multiple, layout.row_multiple
    lengths = [padded_length(all_lengths[i], seq_m) for i in rows]
    groups = token_budget_microbatches(lengths, max(row_m, max_tokens // row_m * row_m))
    mbs = [build_microbatch(batch, [rows[i] for i in g], seq_m, chunk_tokens, vision, row_multiple=row_m)
           for g in groups]
    for mb in mbs:
        layout.check(mb.cu_seqlens.tolist())
    return mbs
