"""Host offload on CPU: moving training state off the "GPU" and back, as strict device mode sees it.

`TrainModel.offload` / `onload` move weights, gradients and optimizer state between the GPU and
host memory while a colocated rollout engine runs. Without CUDA they used to do nothing, so the
CPU suite could not notice a move that breaks what the model reads afterwards. The trap is that
a move between devices is a copy: `t.data = t.data.cpu()` and then `.cuda()` leave `t` with new
storage, cut off from every view that used to share the old one (megatron's distributed
optimizer updates parameter shards that are views of DDP's parameter buffer, and the model reads
that buffer).

Strict device mode (`megarl.parallel.strict_device`) already models the copy: `.cpu()` /
`.to("cpu")` of a tensor it marks as on the device return unmarked host copies, and `.cuda()` /
`.to(cuda)` return marked copies, never the tensor itself. `enable()` (after strict device mode,
by a test or tool that wants the offload path; nothing turns it on by default) adds the rest:

- `available()` is true, so `TrainModel.offload` / `onload` run the code they run on a GPU;
- `Tensor.pin_memory()` of a host tensor returns a host copy (on a GPU machine: a pinned copy;
  without an accelerator torch refuses) and fails for a device tensor, as CUDA does; a factory
  call with `pin_memory=True` allocates plain host memory;
- assigning `.data` of a tensor a tensor on the other "device" resets its autograd gradient
  accumulator, as torch does on a GPU (`VariableHooks::set_data` drops it when the device changes;
  on CPU both sides are the CPU and it stays): hooks hung on the old accumulator (megatron DDP's
  grad hook, which fills `main_grad`) no longer run;
- `device_bytes(tensors)` counts the device memory a set of tensors holds (each storage once),
  so a test can check that an offload really emptied the device.

Storage resized in place (`storage().resize_(0)` and back, what megatron DDP's buffers do) keeps
its mark and its views, as on a GPU. What CPU cannot show: timing (non-blocking copies, streams),
pinned-memory limits and the GPU allocator's real usage.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from megarl.parallel import strict_device

_ENABLED = False


def enabled() -> bool:
    return _ENABLED


def available() -> bool:
    """Whether training state can move off the device and back: on a GPU, or on CPU with this
    model of it enabled."""
    return torch.cuda.is_available() or _ENABLED


def device_bytes(tensors) -> int:
    """Bytes of device storage held by `tensors` (a storage shared by several counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        on = t.is_cuda if torch.cuda.is_available() else strict_device.on_device(t)
        storage = t.untyped_storage()
        if on and storage.nbytes() > 0:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


_SET_DATA = torch.Tensor.data.__set__


def _reset_grad_accumulator(t: torch.Tensor) -> None:
    """Drops `t`'s gradient accumulator the way torch's set_data does on a device change: a
    `.data` of another dtype resets it on any device (the next backward makes a new one)."""
    other = torch.float64 if t.dtype != torch.float64 else torch.float32
    _SET_DATA(t, torch.empty(0, dtype=other))


class _HostOffloadMode(TorchFunctionMode):
    """Pinned host memory as plain host memory; `.data` across devices resets the gradient
    accumulator (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _SET_DATA:
            target, new = args
            if target.requires_grad and strict_device.on_device(target) != strict_device.on_device(new):
                _reset_grad_accumulator(target)
            return func(*args)
        if func is torch.Tensor.pin_memory:
            if any(strict_device.on_device(t) for t in tree_leaves(args[:1])):
                raise strict_device.DeviceMismatchError(
                    "cannot pin 'torch.cuda' tensor: only dense CPU tensors can be pinned")
            return args[0].clone()
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


def enable() -> None:
    """Turns the model on for the life of the process (CPU runtime in strict device mode only)."""
    global _ENABLED
    if _ENABLED:
        return
    if not strict_device.enabled():
        raise RuntimeError("host offload on CPU models device memory: enable strict device mode first "
                           "(megarl.parallel.cpu_runtime.activate(strict=True))")
    _HostOffloadMode().__enter__()  # above the CPU runtime's mode, for the life of the process
    _ENABLED = True
