"""The step's data path in one place: which rank generated a row, which rank trains it, what moved.

1. **Generate.** Every engine owner keeps the trajectories it generated and scored in its
   `RowStore` (the payload: token ids, log-probs, routed experts, images). A `RowMeta` of each,
   the scalars that global decisions need (group id, lengths, score, correctness, finish
   reason, policy versions, ReMax baseline, and the few small fields the PAG / tool metrics
   read), is all-gathered, so every rank holds the round's rows in one global order: rank order,
   then generation order (`gather_metas`).
2. **Decide**, on RowMetas only and identically on every rank: dynamic sampling (the payloads of
   dropped groups are freed where they are: `RowStore.retain`), ReMax baselines, the DP split
   (`megarl.trainer.rl.plan_minibatches`), group advantages from the gathered scores
   (`megarl.trainer.rl.compute_advantages`), the rollout metrics.
3. **Move.** `deliver` sends each payload once, from its source to the ranks of the DP replica
   that trains it (every TP / PP / CP rank of that replica), in one all-to-all over the host
   gloo group (`megarl.parallel.exchange`), with its routed experts cut to the MoE layers of the
   receiving rank's pipeline stage, as uint8 where the expert count allows (`RowTopology`).
   Nothing else of the row reaches any other rank.
4. **Train.** The step's `StepBatch` is built from this rank's rows only.

The metas are authoritative for the scalars decided after generation (ReMax's `baseline_score`):
`deliver` writes them into the payloads it hands over.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass

import numpy as np
import torch

from megarl.parallel import exchange
from megarl.trainer.batch import Trajectory

# the Trajectory fields that travel as raw arrays (the rest of the payload is pickled as is)
_ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "rollout_logprobs": np.float32, "template_mask": np.uint8}


@dataclass
class RowMeta:
    """What every rank knows of a row: where its payload is (`source` rank, `key` in that rank's
    RowStore) and the scalars decisions and metrics read. Attribute names follow `Trajectory`, so
    the functions that decide on rows (dynamic sampling, T-PPO staleness, metrics) take either."""

    source: int
    key: int
    uid: str
    prompt_len: int
    response_len: int
    score: float
    acc: bool
    finish_reason: str
    data_source: str = "math"
    policy_version: int = 0
    baseline_score: float | None = None
    window_start: int = 0
    start_version: int | None = None
    turn_ends: list[int] | None = None  # PAG: the turn layout (its metrics read it)
    turn_is_policy: list[bool] | None = None
    turn_outcome: list[int] | None = None
    tool_stats: dict | None = None  # tool-calling rollouts: turns, calls, errors, how it ended

    @property
    def first_version(self) -> int:
        return self.policy_version if self.start_version is None else self.start_version

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def ref(self) -> tuple[int, int]:
        return self.source, self.key


def meta_of(t: Trajectory, source: int, key: int) -> RowMeta:
    small = {f.name: getattr(t, f.name) for f in dataclasses.fields(RowMeta)
             if f.name not in ("source", "key", "prompt_len", "response_len")}
    return RowMeta(source=source, key=key, prompt_len=len(t.prompt_ids), response_len=len(t.response_ids), **small)


def _nbytes(*tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors if torch.is_tensor(x))


def image_bytes(t: Trajectory) -> int:
    """Bytes of a row's images and videos (pixels and grids)."""
    return _nbytes(t.pixel_values, t.image_grid_thw, *(t.videos or {}).values())


def payload_bytes(t: Trajectory) -> int:
    """Bytes of a row's payload as it travels: int32 token ids, float32 log-probs, uint8 template
    mask, and its tensors (routed experts, images); the small fields are not counted."""
    n = 4 * (len(t.prompt_ids) + len(t.response_ids)) + 4 * len(t.rollout_logprobs)
    return n + len(t.template_mask or []) + _nbytes(t.routed_experts) + image_bytes(t)


@dataclass
class RowTable:
    """The step's rows as per-sample vectors, in global order and the same on every rank: what
    `megarl.trainer.rl.compute_advantages` needs of the rows other ranks train."""

    uid: list[str]
    score: torch.Tensor  # [N] float32
    response_lengths: torch.Tensor  # [N] float32 response tokens
    baseline_score: torch.Tensor | None  # [N] float32 ReMax baseline, or None

    @classmethod
    def of(cls, rows: list[RowMeta]) -> "RowTable":
        base = [m.baseline_score for m in rows]
        return cls(uid=[m.uid for m in rows], score=torch.tensor([float(m.score) for m in rows], dtype=torch.float32),
                   response_lengths=torch.tensor([float(m.response_len) for m in rows], dtype=torch.float32),
                   baseline_score=(torch.tensor(base, dtype=torch.float32)
                                   if rows and all(b is not None for b in base) else None))

    def __len__(self) -> int:
        return len(self.uid)


class RowStore:
    """The payloads this rank generated and still owns, by key; counts their bytes and the peak."""

    def __init__(self):
        self._rows: dict[int, Trajectory] = {}
        self._bytes: dict[int, int] = {}
        self._next = 0
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def add(self, trajs: list[Trajectory]) -> list[int]:
        keys = []
        for t in trajs:
            self._rows[self._next], self._bytes[self._next] = t, payload_bytes(t)
            keys.append(self._next)
            self._next += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return keys

    def get(self, key: int) -> Trajectory:
        return self._rows[key]

    def replace(self, key: int, t: Trajectory) -> None:
        self._rows[key], self._bytes[key] = t, payload_bytes(t)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def drop(self, keys) -> None:
        for k in list(keys):
            self._rows.pop(k, None)
            self._bytes.pop(k, None)

    def retain(self, keys) -> None:
        """Frees every payload whose key is not in `keys`."""
        keep = set(keys)
        for k in [k for k in self._rows if k not in keep]:
            del self._rows[k], self._bytes[k]

    def state_dict(self, keys=None) -> dict:
        """The payloads of `keys` (all: None) as plain values and tensors (loads with
        torch.load(weights_only=True); `restore_rows` reads them back)."""
        keep = None if keys is None else set(keys)
        return {"next": self._next,
                "rows": {int(k): t.state() for k, t in self._rows.items() if keep is None or k in keep}}


@dataclass(frozen=True)
class RowTopology:
    """Who trains what: the DP rank of every global rank, the MoE layers (global indices) of its
    pipeline stage (None: no routing replay on that rank), and the dtype routed experts travel in."""

    dp_of: tuple[int, ...]
    layers_of: tuple[tuple[int, ...] | None, ...]
    routing_dtype: torch.dtype = torch.int16

    @classmethod
    def gather(cls, dp_rank: int, moe_layers: list[int] | None, num_experts: int = 0) -> "RowTopology":
        """Collective: every rank's DP rank and MoE layers."""
        parts = exchange.all_gather_objects((dp_rank, None if moe_layers is None else tuple(moe_layers)), "setup")
        return cls(tuple(p[0] for p in parts), tuple(p[1] for p in parts), routing_dtype(num_experts))

    def ranks_of_dp(self, dp: int) -> list[int]:
        return [r for r, d in enumerate(self.dp_of) if d == dp]


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 when every expert index fits (<= 256 experts), else int16."""
    return torch.uint8 if 0 < num_experts <= 256 else torch.int16


def for_rank(t: Trajectory, layers: tuple[int, ...] | None, dtype: torch.dtype) -> Trajectory:
    """The row as rank with MoE `layers` trains it: routed experts [tokens, len(layers), top_k]
    in `dtype` (dropped where the rank replays nothing)."""
    r = t.routed_experts
    if r is None:
        return t
    routed = None if layers is None else r[:, list(layers)].to(dtype)
    return dataclasses.replace(t, routed_experts=routed)


_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory))


def encode_row(t: Trajectory) -> tuple:
    """A row's payload as it travels: its field values in `Trajectory` order (no names), token ids
    as int32 bytes, log-probs as float32 bytes, the template mask as uint8 bytes, every tensor as
    (dtype, shape, raw bytes)."""
    return tuple(np.asarray(v, dtype=_ARRAYS[k]).tobytes() if k in _ARRAYS and v is not None else _pack(v)
                 for k, v in ((k, getattr(t, k)) for k in _FIELDS))


def decode_row(values: tuple) -> Trajectory:
    d = {k: _unpack(v) for k, v in zip(_FIELDS, values)}
    for k, dt in _ARRAYS.items():
        if d[k] is not None:
            d[k] = np.frombuffer(d[k], dtype=dt).tolist()
    return Trajectory(**d)


class _Tensor(tuple):
    """(dtype name, shape, raw bytes) of a tensor on the wire."""


def _pack(v):
    if torch.is_tensor(v):
        c = v.detach().cpu().contiguous()
        return _Tensor((str(c.dtype).removeprefix("torch."), tuple(c.shape), c.view(-1).view(torch.uint8).numpy().tobytes()))
    if isinstance(v, dict):
        return {k: _pack(x) for k, x in v.items()}
    return v


def _unpack(v):
    if isinstance(v, _Tensor):
        dtype, shape, raw = v
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if isinstance(v, dict):
        return {k: _unpack(x) for k, x in v.items()}
    return v


def wire_bytes(rows: list[Trajectory]) -> int:
    """Bytes of the message that carries these rows to one rank (`deliver`)."""
    return len(_dumps([(i, encode_row(t)) for i, t in enumerate(rows)]))


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def gather_metas(store: RowStore, trajs: list[Trajectory], rank: int) -> list[RowMeta]:
    """Stores this rank's new trajectories and returns every rank's metas, in global order."""
    keys = store.add(trajs)
    parts = exchange.all_gather_objects([meta_of(t, rank, k) for t, k in zip(trajs, keys)])
    return [m for p in parts for m in p]


def deliver(store: RowStore, rows: list[RowMeta], dp_of_row: list[int], topo: RowTopology,
            rank: int) -> dict[int, Trajectory]:
    """Moves row i's payload from its source to every rank of DP replica dp_of_row[i]; returns
    {i: trajectory} of the rows this rank trains. Collective; the store keeps its payloads (the
    caller frees what is no longer needed with `RowStore.retain`)."""
    world = len(topo.dp_of)
    sends: list[list] = [[] for _ in range(world)]
    mine: dict[int, Trajectory] = {}
    for i, (m, dp) in enumerate(zip(rows, dp_of_row)):
        if m.source != rank:
            continue
        t = dataclasses.replace(store.get(m.key), baseline_score=m.baseline_score)
        cut: dict = {}  # one copy per distinct MoE layer set
        for r in topo.ranks_of_dp(dp):
            layers = topo.layers_of[r]
            if layers not in cut:
                cut[layers] = for_rank(t, layers, topo.routing_dtype)
            if r == rank:
                mine[i] = cut[layers]
            else:
                sends[r].append((i, encode_row(cut[layers])))
    received = exchange.all_to_all_bytes([_dumps(s) if s else b"" for s in sends])
    for blob in received:
        if blob:
            mine.update((i, decode_row(v)) for i, v in pickle.loads(blob))
    return mine


# ---- checkpoints: every rank saves the payloads of the rows it carries into the next step -----
ROWS_DIR = "rows"


def rank_rows(store: RowStore, carried: list[RowMeta], rank: int) -> dict:
    """What this rank saves in a checkpoint: the payloads of the carried rows it holds."""
    return store.state_dict(m.key for m in carried if m.source == rank)


def restore_rows(ckpt_dir, store: RowStore, rank: int, world: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Collective: loads a checkpoint's row payloads into the stores (the file of rank f goes to
    rank f % world, so the same world gets its own rows back) and returns, on every rank,
    (saved source, saved key) -> (source, key) now."""
    from pathlib import Path

    where: dict[tuple[int, int], tuple[int, int]] = {}
    for path in sorted(Path(ckpt_dir, ROWS_DIR).glob("rank*.pt")):
        saved = int(path.stem.removeprefix("rank"))
        if saved % world != rank:
            continue
        sd = torch.load(path, weights_only=True)
        for k, t in sorted(sd["rows"].items()):
            where[(saved, int(k))] = (rank, store.add([Trajectory(**t)])[0])
    merged: dict = {}
    for part in exchange.all_gather_objects(where, "setup"):
        merged.update(part)
    return merged
