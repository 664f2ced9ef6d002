"""Training state off the GPU and back (TrainModel.offload / onload), in two parts.

- "state": the gradients (DDP's gradient buffers, dropped: they are zeroed before every update)
  and the optimizer's own tensors that are not the weights (fp32 main params, Adam moments).
- "weights": the model's parameters (DDP's parameter buffers, or each parameter).

The colocated loop moves the state before the engine's weights come back for the weight sync (the
trainer's weights stay: they are the stream's source), the weights after it, for generation, and
everything returns for training (megarl.trainer.components).

Every move keeps the tensor objects and moves their storage in place: a pinned host copy, then
the device storage resized to 0; back: resized, then copied into. Every view, the parameter object
and its autograd gradient accumulator survive. Assigning `p.data` a tensor on another device
instead resets the parameter's gradient accumulator (torch `VariableHooks::set_data`), and
megatron-core's DDP hangs the hook that fills `main_grad` on that accumulator
(distributed_data_parallel.py, `grad_accs`): after one round trip `main_grad` stays zero and the
optimizer steps on nothing.

Why not megatron's own `optimizer.offload_to_cpu()` / `restore_from_cpu()` (megatron-core 0.16.1,
optimizer/optimizer.py): they assign `p.data = p.data.cpu()` (the reset above), and with the
distributed optimizer some of those parameters are views of DDP's parameter buffer
(distrib_optimizer.py, `_build_model_and_main_param_groups`: fp32 shards always; bf16 shards with
the precision-aware optimizer that `offload_optimizer=true` turns on): the copy cuts them off the
buffer the model reads, and HybridDeviceOptimizer's updates (copied into those views,
hybrid_optimizer.py) never reach the model. They also move every host tensor of the optimizer state
to the GPU on restore: HybridDeviceOptimizer keeps its Adam state and fp32 master weights on the CPU.

Here DDP's buffers move with their own `offload_to_cpu` / `reload_from_cpu`
(distributed/param_and_grad_buffer.py: storage resized in place), a tensor inside one is left to
its buffer, only tensors on the GPU are moved, and exactly those come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PARTS = ("state", "weights")  # the order they leave in; they come back in the reverse order


@dataclass
class Moved:
    """What `to_host` moved, for `to_device` to bring back."""

    part: str
    storages: list = field(default_factory=list)  # (device storage, its bytes, host copy)
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


def _key(t) -> int:
    """The identity of `t`'s storage (stable across resizes, unlike its data pointer)."""
    return t.untyped_storage()._cdata


def _flat(storage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`, on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storage_to_host(storage, hosts: dict) -> tuple:
    """(storage, its bytes, pinned host copy): the copy is made and the storage resized to 0. The
    pinned buffer of an earlier round trip (in `hosts`, by storage) is reused: pinning is slow."""
    n = storage.nbytes()
    if not storage.resizable():
        raise RuntimeError(f"offload: a storage of {n} bytes cannot be resized in place (not allocated by torch)")
    key = storage._cdata
    host = hosts.get(key)
    if host is None or host.numel() != n:
        host = hosts[key] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.copy_(_flat(storage), non_blocking=True)
    storage.resize_(0)  # freed on the current stream, after the copy
    return storage, n, host


def buffers_of(chunks) -> list:
    """DDP's parameter / gradient buffers of `chunks`."""
    return [b for c in chunks if _is_ddp(c) for b in list(c.buffers) + list(c.expert_parallel_buffers)]


def weight_tensors(chunks) -> list:
    """The model's parameters and the parameter buffers they live in (with the distributed optimizer)."""
    return ([p for c in chunks for p in c.parameters()]
            + [b.param_data for b in buffers_of(chunks) if b.param_data is not None])


def gradient_tensors(chunks, optimizer) -> list:
    """DDP's gradient buffers, every parameter's main_grad / grad and the optimizer params' grads."""
    out = [b.grad_data for b in buffers_of(chunks) if b.grad_data is not None]
    for p in [p for c in chunks for p in c.parameters()] + optimizer_params(optimizer):
        out += [g for g in (getattr(p, "main_grad", None), p.grad) if torch.is_tensor(g)]
    return out


def optimizer_params(optimizer) -> list:
    return [p for inner in _inner_optimizers(optimizer) for g in inner.param_groups for p in g["params"]]


def optimizer_state_tensors(optimizer) -> list:
    return [v for inner in _inner_optimizers(optimizer) for st in inner.state.values()
            for v in st.values() if torch.is_tensor(v)]


def to_host(chunks, optimizer, part: str, hosts: dict | None = None) -> Moved:
    """Moves one part (PARTS) of the training state of `chunks` and `optimizer` to the host;
    `hosts` keeps the pinned host buffers from one round trip to the next."""
    if part not in PARTS:
        raise ValueError(f"offload part {part!r}: expected one of {PARTS}")
    moved = Moved(part, buffers=buffers_of(chunks))
    weights = {_key(t) for t in weight_tensors(chunks)}
    if part == "state":
        tensors = [p for p in optimizer_params(optimizer) if _key(p) not in weights]
        tensors += optimizer_state_tensors(optimizer)
        for p in optimizer_params(optimizer) + [p for c in chunks for p in c.parameters()]:
            p.grad = None  # recomputed by the next step (DDP's hook, then the optimizer from main_grad)
    else:
        in_buffer = {_key(b.param_data) for b in moved.buffers if b.param_data is not None}
        tensors = [p for c in chunks for p in c.parameters() if _key(p) not in in_buffer]
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if t.is_cuda and storage.nbytes() > 0 and _key(t) not in seen:
            seen.add(_key(t))
            moved.storages.append(_storage_to_host(storage, {} if hosts is None else hosts))
    for buf in moved.buffers:
        buf.offload_to_cpu(move_params=part == "weights", move_grads=part == "state")
    return moved


def host_view(moved: Moved, param: torch.Tensor) -> torch.Tensor | None:
    """The host copy of `param`'s values while the "weights" part is off the GPU (a view into the
    pinned copy of its storage or of its DDP buffer); None when `param` was not moved."""
    for buf in moved.buffers:
        if buf.param_data is not None and buf.param_data_cpu is not None and param in buf.param_index_map:
            start, end, _ = buf.param_index_map[param]
            return buf.param_data_cpu[start:end].view(param.shape)
    key = _key(param)
    for storage, _, host in moved.storages:
        if storage._cdata == key:
            return torch.as_strided(host.view(param.dtype), param.shape, param.stride(), param.storage_offset())
    return None


def to_device(moved: Moved) -> None:
    """Undoes `to_host`: the buffers are reloaded in place, the moved storages refilled."""
    for buf in moved.buffers:
        buf.reload_from_cpu(move_params=moved.part == "weights", move_grads=moved.part == "state")
    for storage, n, host in moved.storages:
        storage.resize_(n)
        _flat(storage).copy_(host, non_blocking=True)
