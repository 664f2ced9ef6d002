"""The optimizer's torch_dist checkpoint, each rank writing and reading only its own shard.

Format: megatron-core's `fully_reshardable` distributed-optimizer format. Every optimizer state
of a parameter ('param' = fp32 main weights, 'exp_avg', 'exp_avg_sq') is a float32 tensor of the
model parameter's global shape under the key `optimizer.state.<state>.<model key>`, and the
non-tensor state (param groups, step, grad scaler, `param_state_sharding_type`) is in common.pt,
per optimizer of megatron's chain ({i: ...}: dense and, at EP>1, expert-parallel). The torch_dist
files store each tensor as rectangular chunks.

megatron's own `fully_reshardable` code all-gathers the whole data-parallel group's state on
every rank before a save, and every rank reads whole parameters at load: ~12 bytes x parameters
of the model-parallel shard per rank, whatever the DP size. Here a rank writes only the range
of each parameter its distributed optimizer owns (a contiguous range of the flattened local
tensor), cut into the fewest rectangular chunks of the global tensor (`contiguous_boxes`), and
at load asks torch DCP for exactly those chunks (DCP reads the overlap of the requested and the
stored chunks, so any DP / TP / PP / EP layout loads). Save and load touch only the rank's own
1/DP share. Checkpoints of megatron's gathering writer (one whole chunk per tensor, keys
prefixed `chained_<i>.` in a chain) load here; these load with megatron's reader given
`chained_optim_avoid_prefix=True` (megarl writes the keys unprefixed: a model key names one
parameter, whichever optimizer of the chain holds it, so EP=1 <-> EP>1 reshards too).

megatron's gather-free format of 0.16.1, `fully_sharded_model_space`, describes the ranges
with `ShardedTensor.flattened_range`, which 0.16.1's `validate_metadata_integrity` rejects;
`dp_reshardable` stores the optimizer's internal buckets and reshards only over DP. Hence this
module. Optimizers other than the distributed one hold the whole model-parallel shard on every
rank anyway; their own sharded state dict is used (written by DP rank 0, read by every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megarl.weights.dist_ckpt import dcp_metadata
from megarl.weights.hf_reader import CheckpointError

SHARDING_TYPE = "fully_reshardable"
METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE}
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def contiguous_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major index range [start, stop) of an array of `shape` as (offset, size) boxes, in
    order, each box contiguous in memory (its flat elements follow one another).

    Greedy: at flat position p (multi-index i), the outermost axis k with p % stride_k == 0
    (stride_k = prod(shape[k+1:])) that still fits a slab gives the box of size
    (1, .., 1, n, shape[k+1], .., shape[-1]) with n = min(shape[k] - i_k, (stop - p) // stride_k).
    At most 2 * ndim - 1 boxes."""
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    boxes, pos = [], start
    while pos < stop:
        index = [(pos // strides[k]) % shape[k] for k in range(len(shape))]
        for k in range(len(shape)):
            n = min(shape[k] - index[k], (stop - pos) // strides[k])
            if pos % strides[k] == 0 and n >= 1:
                boxes.append((tuple(index), (1,) * k + (n,) + tuple(shape[k + 1:])))
                pos += n * strides[k]
                break
    return boxes


@dataclass
class _Piece:
    """A regular ShardedTensor (data None) of a model parameter and where its data starts in the
    parameter's flattened local tensor (several for a ShardedTensorFactory, e.g. SwiGLU's
    gate and up halves of linear_fc1, stored at different places of the global tensor)."""

    sharded: object
    flat_start: int


def _pieces(model_sharded, state_key: str) -> list[_Piece]:
    """`model_sharded` (ShardedTensor or ShardedTensorFactory of a model parameter) as regular
    ShardedTensors keyed `optimizer.state.<state_key>.<key>`, each with its flat start."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    key = f"optimizer.state.{state_key}.{model_sharded.key}"
    if model_sharded.flattened_range is not None:
        raise CheckpointError(f"model tensor {model_sharded.key} is flattened; not supported")
    if isinstance(model_sharded, ShardedTensor):
        return [_Piece(replace(model_sharded.without_data(), key=key), 0)]
    if not isinstance(model_sharded, ShardedTensorFactory):
        raise CheckpointError(f"model tensor {model_sharded.key}: unexpected {type(model_sharded).__name__}")
    # the factory's split, learnt on a data-less tensor: its pieces must be contiguous views
    local = torch.empty(model_sharded.data.shape, dtype=torch.float32, device="meta")
    out = []
    for sub in nested_values(model_sharded.build_fn(key, local, model_sharded.replica_id, None)):
        if not isinstance(sub, ShardedTensor) or sub.flattened_range is not None:
            raise CheckpointError(f"model tensor {model_sharded.key}: its factory builds {type(sub).__name__}")
        view = sub.data
        if not (view is local or view._base is local) or not view.is_contiguous():
            raise CheckpointError(f"model tensor {model_sharded.key}: its factory's pieces are not contiguous "
                                  "views of the parameter; the sharded optimizer checkpoint cannot map them")
        out.append(_Piece(sub.without_data(), view.storage_offset()))
    out.sort(key=lambda p: p.flat_start)
    ends = [p.flat_start + math.prod(p.sharded.local_shape) for p in out]
    if [p.flat_start for p in out] != [0] + ends[:-1] or ends[-1] != local.numel():
        raise CheckpointError(f"model tensor {model_sharded.key}: its factory's pieces do not tile the parameter")
    return out


def _boxes(piece: _Piece, flat: torch.Tensor, start: int, stop: int, replica_id) -> list:
    """ShardedTensors (irregular grid) of the part [start, stop) of the parameter's flattened
    local tensor that falls in `piece`; `flat` holds exactly [start, stop)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sh = piece.sharded
    pre, local_shape = sh.prepend_axis_num, tuple(sh.local_shape)
    lo = max(start, piece.flat_start)
    hi = min(stop, piece.flat_start + math.prod(local_shape))
    strides = [math.prod(local_shape[k + 1:]) for k in range(len(local_shape))]
    out = []
    for offset, size in contiguous_boxes(local_shape, lo - piece.flat_start, hi - piece.flat_start):
        first = piece.flat_start + sum(o * s for o, s in zip(offset, strides)) - start
        shape = (1,) * pre + size
        data = flat[first:first + math.prod(size)].view(shape)
        out.append(ShardedTensor(
            sh.key, data, data.dtype, shape, tuple(sh.global_shape),
            tuple(sh.global_offset[:pre]) + tuple(g + o for g, o in zip(sh.global_offset[pre:], offset)),
            axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=0,
            allow_shape_mismatch=sh.allow_shape_mismatch))
    return out


def _owned(opt):
    """(model parameter, range of its flattened local tensor this DP rank's optimizer holds), in
    megatron's order (the one `load_parameter_state_from_fs_model_space` reads)."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    yield model_param, ranges["param"]


def _distributed_state(opt, model_sd: dict, is_loading: bool) -> tuple[dict, list[dict]]:
    """A DistributedOptimizer's sharded state dict in the format of the module doc, and per owned
    parameter the flat float32 tensors its chunks are views of (fresh ones when loading)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    common = opt.state_dict()  # param groups, step, grad scaler (megarl's CPU runtime fills Adam state)
    # HybridDeviceOptimizer (offload_optimizer) copies its optimizer classes into every param group
    # (it reads them from its own attributes, never from there): common.pt must load weights_only
    common["optimizer"] = {**common["optimizer"], "param_groups": [
        {k: v for k, v in g.items() if not isinstance(v, type)} for g in common["optimizer"]["param_groups"]]}
    if is_loading:
        opt.load_state_dict(opt.state_dict())  # allocates the state, as megatron's sharded_state_dict does
    sharded, _ = extract_sharded_tensors_and_factories(model_sd)
    by_param = {id(sh.data): sh for sh in nested_values(sharded)}
    param_state, flats = {}, []
    for idx, (model_param, rng) in enumerate(_owned(opt)):
        model_sharded = by_param.get(id(model_param))
        if model_sharded is None:
            raise CheckpointError(f"an optimizer parameter of shape {tuple(model_param.shape)} is not in the "
                                  "model's sharded state dict")
        rid = model_sharded.replica_id
        if not (isinstance(rid, tuple) and len(rid) == 3):
            raise CheckpointError(f"model tensor {model_sharded.key}: replica_id {rid!r} is not (PP, TP, DP)")
        replica_id = (*rid[:2], opt.distributed_optimizer_instance_id)  # every DP rank writes its own range
        states = opt._get_main_param_and_optimizer_states(model_param)
        flat_of, entry = {}, {}
        for key in STATE_KEYS:
            held = states[key].detach().reshape(-1)
            if is_loading:  # host memory, as megatron's reader: copied into the state by `apply_loaded`
                flat = torch.empty(held.numel(), dtype=torch.float32)
            else:
                flat = held if held.dtype == torch.float32 else held.float()
            flat_of[key] = flat
            entry[key] = [box for piece in _pieces(model_sharded, key)
                          for box in _boxes(piece, flat, rng.start, rng.end, replica_id)]
        param_state[idx] = entry
        flats.append(flat_of)
    common["param_state"] = param_state
    common["param_state_sharding_type"] = SHARDING_TYPE
    return common, flats


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def sharded_state_dict(optimizer, model_sd: dict, is_loading: bool = False) -> tuple[dict, list]:
    """The optimizer's sharded state dict (for dist_checkpointing.save / load) in the format of
    the module doc, and what `apply_loaded` needs after a load. `model_sd`: the model chunks'
    sharded state dict (megarl.weights.dist_ckpt.model_sharded_state_dict). A chain of several
    optimizers gives {i: state of optimizer i}, its tensors under their model keys, unprefixed."""
    subs = _sub_optimizers(optimizer)
    if len(subs) > 1:
        optimizer._synchronize_steps()
    parts, flats = {}, []
    for i, opt in enumerate(subs):
        if _is_distributed(opt):
            parts[i], f = _distributed_state(opt, model_sd, is_loading)
        else:
            parts[i], f = opt.sharded_state_dict(model_sd, is_loading, metadata=METADATA), None
        flats.append(f)
    return (parts if len(subs) > 1 else parts[0]), flats


def saved_commons(opt_dir: str | Path) -> list:
    """The non-tensor state of every optimizer of the chain saved in opt_dir/common.pt, in order."""
    common = torch.load(Path(opt_dir) / "common.pt", map_location="cpu", weights_only=True)
    if isinstance(common, dict) and common and all(isinstance(k, int) for k in common):
        return [common[k] for k in sorted(common)]
    return [common]


def _check_saved(optimizer, commons: list, path: Path) -> None:
    """Raises CheckpointError naming common.pt unless this optimizer can read the saved one: the
    same kind (distributed or not), SHARDING_TYPE, and a chain of another length only between
    distributed optimizers (EP=1 <-> EP>1 moves the experts between megatron's dense and expert
    optimizers)."""
    saved = [c.get("param_state_sharding_type") if isinstance(c, dict) else None for c in commons]
    want = [SHARDING_TYPE if _is_distributed(o) else None for o in _sub_optimizers(optimizer)]
    if saved == want or (set(saved) == set(want) == {SHARDING_TYPE}):
        return
    if set(saved) == set(want) == {None}:
        raise CheckpointError(
            f"{path}: saved by a chain of {len(saved)} optimizers, this one has {len(want)}: megatron's "
            "non-distributed optimizer keeps experts in a separate optimizer only at EP>1, and its "
            "checkpoint loads only into the same chain; resume at EP=1 or EP>1 as saved, or use the "
            "distributed optimizer (actor/critic.use_distributed_optimizer)")
    raise CheckpointError(
        f"{path}: optimizer state saved as {saved} (megatron's distrib_optim_sharding_type per chained "
        f"optimizer, None = not the distributed optimizer), but this optimizer reads {want}: megarl reads "
        f"{SHARDING_TYPE!r} checkpoints, with use_distributed_optimizer as when they were saved")


def _common_for(opt, i: int, n_chain: int, commons: list, path: Path) -> dict:
    """The saved non-tensor state optimizer i of the chain loads: the saved optimizer i's when
    the chains match, else every saved param group with this optimizer's is_expert_parallel
    (megatron matches groups by wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr; the
    groups of a chain share hyper-parameters and step)."""
    if len(commons) == n_chain:
        return commons[i]
    expert = {g["is_expert_parallel"] for g in opt.optimizer.param_groups}
    if len(expert) != 1:
        raise CheckpointError(f"{path}: cannot regroup the saved param groups for an optimizer mixing "
                              "expert-parallel and dense parameters")
    is_expert = expert.pop()
    groups = [{**g, "is_expert_parallel": is_expert} for c in commons for g in c["optimizer"]["param_groups"]]
    return {**commons[0], "optimizer": {**commons[0]["optimizer"], "param_groups": groups}}


def _use_saved_keys(sd: dict, saved: set[str], path: Path) -> None:
    """Renames every ShardedTensor of `sd` to the key the checkpoint holds it under: its own, or
    with megatron's chain prefix `chained_<j>.` (the gathered writer of megatron)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    chained: dict[str, list[str]] = {}
    for k in saved:
        if k.startswith("chained_") and "." in k:
            chained.setdefault(k.split(".", 1)[1], []).append(k)
    for sh in nested_values(sd):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or sh.key in saved:
            continue
        found = chained.get(sh.key, [])
        if len(found) != 1:
            raise CheckpointError(f"{path}: the checkpoint has no optimizer tensor {sh.key!r} "
                                  f"({len(found)} under megatron's chained_<i>. prefix)")
        sh.key = found[0]


def apply_loaded(optimizer, state: dict, flats: list, commons: list, path: Path) -> None:
    """Puts what dist_checkpointing.load returned for `sharded_state_dict(..., is_loading=True)`
    into the optimizer: the flat tensors of `flats` hold the loaded chunks; the non-tensor state
    comes from the saved `commons` (`_common_for`)."""
    subs = _sub_optimizers(optimizer)
    for i, opt in enumerate(subs):
        part = state[i] if len(subs) > 1 else state
        if flats[i] is None:
            opt.load_state_dict(part)
            continue
        common = dict(_common_for(opt, i, len(subs), commons, path))
        common.pop("param_state_sharding_type")
        opt.load_state_dict(common)  # without param_state: param groups, step, grad scaler
        loaded = {}
        for idx, flat_of in enumerate(flats[i]):
            for key, chunks in part["param_state"][idx].items():
                _fill(flat_of[key], chunks)
            loaded[idx] = {"fp32_param": flat_of["param"], "exp_avg": flat_of["exp_avg"],
                           "exp_avg_sq": flat_of["exp_avg_sq"]}
        opt.load_parameter_state_from_fs_model_space(loaded)
    if len(subs) > 1:
        optimizer._synchronize_steps()


def _fill(flat: torch.Tensor, chunks: list[torch.Tensor]) -> None:
    """The loaded chunks, in order, make up `flat` (DCP loads into the views it was given; a
    copy only where a chunk came back as another tensor)."""
    pos = 0
    for chunk in chunks:
        n = chunk.numel()
        view = flat[pos:pos + n]
        if chunk.data_ptr() != view.data_ptr():
            view.copy_(chunk.reshape(-1))
        pos += n
    if pos != flat.numel():
        raise CheckpointError(f"loaded {pos} optimizer values for a range of {flat.numel()}")


def save(optimizer, model_sd: dict, opt_dir: str | Path, async_save: bool = False):
    """Collective: writes this rank's share of the optimizer state to the torch_dist directory
    opt_dir (which exists); with async_save, returns megatron's AsyncRequest instead of writing."""
    from megatron.core import dist_checkpointing

    sd, _ = sharded_state_dict(optimizer, model_sd)
    return dist_checkpointing.save(sd, str(opt_dir), async_sharded_save=async_save)


def load(optimizer, model_sd: dict, opt_dir: str | Path) -> None:
    """Collective: reads this rank's share of the optimizer state from opt_dir (checked with
    megarl.weights.dist_ckpt.check_checkpoint_files first), saved by `save` or by megatron's
    gathering `fully_reshardable` writer, under any DP / TP / PP / EP layout."""
    from megatron.core import dist_checkpointing

    opt_dir = Path(opt_dir)
    commons = saved_commons(opt_dir)
    _check_saved(optimizer, commons, opt_dir / "common.pt")
    sd, flats = sharded_state_dict(optimizer, model_sd, is_loading=True)
    _use_saved_keys(sd, set(dcp_metadata(opt_dir).state_dict_metadata), opt_dir)
    apply_loaded(optimizer, dist_checkpointing.load(sd, str(opt_dir)), flats, commons, opt_dir / "common.pt")
