"""Training state off the GPU and back (TrainModel.offload / onload).

Why not megatron's own `optimizer.offload_to_cpu()` / `restore_from_cpu()` (megatron-core 0.16.1,
optimizer/optimizer.py): they replace every optimizer parameter by a copy (`p.data =
p.data.cpu()`, later `p.data.cuda()`), and move every host tensor of the optimizer state to the
GPU on restore, whether or not it came from there.

- With the distributed optimizer some of those parameters are views of DDP's parameter buffer
  (distrib_optimizer.py, `_build_model_and_main_param_groups`: fp32 shards always; bf16 shards
  with the precision-aware optimizer that `offload_optimizer=true` turns on). The copy cuts them
  off the buffer the model reads. With HybridDeviceOptimizer (optimizer_cpu_offload) the update
  is copied into those detached tensors (hybrid_optimizer.py, the step post-hook) and the
  distributed optimizer skips its own main -> model copy in precision-aware mode
  (`_copy_main_params_to_model_params`): every update after the first round trip is lost. For
  fp32 shards the update still reaches the buffer, but each restore allocates a second copy of
  1/DP of the weights on the GPU.
- HybridDeviceOptimizer keeps its Adam state and fp32 master weights on the CPU; the restore
  would move them onto the GPU under the CPU Adam.

Here a tensor inside a DDP parameter buffer is left alone (DDP's `offload_to_cpu` /
`reload_from_cpu`, distributed/param_and_grad_buffer.py, resize that buffer's storage in place, so
every view of it stays valid), only tensors on the GPU are moved, and exactly those come back.

Without the distributed optimizer DDP allocates no parameter buffer (`param_data` is None) and its
offload skips the weights: they are moved one parameter at a time here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Moved:
    """What `to_host` moved, for `to_device` to bring back."""

    tensors: list = field(default_factory=list)  # parameters / tensors whose .data went to the host
    state: list = field(default_factory=list)  # (optimizer state dict, key) of moved state tensors
    buffers: list = field(default_factory=list)  # DDP param/grad buffers


def _is_ddp(chunk) -> bool:
    from megatron.core.distributed import DistributedDataParallel

    return isinstance(chunk, DistributedDataParallel)


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under a megatron optimizer (one, or one per chained optimizer)."""
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not getattr(opt, "is_stub_optimizer", False):
            out.append(inner)
    return out


def to_host(chunks, optimizer) -> Moved:
    """Moves the GPU-resident optimizer tensors, the weights and the gradients of `chunks` to the
    host (gradients are dropped: they are zeroed before every update)."""
    moved = Moved()
    for c in chunks:
        if _is_ddp(c):
            moved.buffers += list(c.buffers) + list(c.expert_parallel_buffers)
    # storages of the buffers' parameter data: DDP moves them in place, their views stay valid
    in_buffer = {b.param_data.untyped_storage().data_ptr() for b in moved.buffers
                 if b.param_data is not None and b.param_data.numel() > 0}
    seen: set[int] = set()

    def move(t) -> None:
        if id(t) in seen or not t.is_cuda or t.untyped_storage().data_ptr() in in_buffer:
            return
        seen.add(id(t))
        t.data = t.data.cpu()
        moved.tensors.append(t)

    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                move(p)
        for st in inner.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.is_cuda and v.untyped_storage().data_ptr() not in in_buffer:
                    st[k] = v.cpu()
                    moved.state.append((st, k))
    for c in chunks:
        if not _is_ddp(c):  # a forward-only model (reference)
            for p in c.parameters():
                move(p)
            continue
        for buf in c.buffers + c.expert_parallel_buffers:
            if buf.param_data is None:  # no distributed optimizer: no buffer holds the weights
                for p in buf.params:
                    move(p)
            buf.offload_to_cpu(move_params=True, move_grads=True)
    return moved


def to_device(moved: Moved) -> None:
    """Undoes `to_host`: the buffers are reloaded in place, the moved tensors copied back."""
    for buf in moved.buffers:
        buf.reload_from_cpu(move_params=True, move_grads=True)
    dev = torch.cuda.current_device()
    for t in moved.tensors:
        t.data = t.data.to(dev, non_blocking=True)
    for st, k in moved.state:
        st[k] = st[k].to(dev, non_blocking=True)
