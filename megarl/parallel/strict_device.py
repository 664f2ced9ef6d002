"""Strict device mode of the CPU runtime: the CPU suite fails where a GPU run would.

On CPU every tensor is a host tensor, so code that forgets to move a micro-batch to the GPU, or
hands a host tensor to an NCCL collective, passes every CPU test and fails on the first cluster
step. In strict mode a tensor that would live on the GPU carries a mark on its storage
(shared by its views and `.data`):

- tensors created with a CUDA device argument (`device="cuda"`, an int, `device()` of
  `megarl.parallel.distributed`), `.cuda()` / `.to(cuda)` copies, and every output of an op
  with a marked input are marked; `.cpu()` / `.to("cpu")` return unmarked copies;
- a marked tensor reports `device == cuda:0` and `is_cuda`, so `device=x.device` code works as
  on a GPU, and `.numpy()` on it fails as it does on a GPU;
- an op that mixes marked and unmarked tensors raises `DeviceMismatchError`, except where CUDA
  allows it (0-dim host scalars, cross-device copies, host index tensors);
- a collective on a group that is NCCL on a GPU (the default group and every group created
  without backend="gloo") raises `DeviceMismatchError` for an unmarked tensor.

`torch.cuda.current_device()` returns 0 as on a GPU; a CUDA `torch.Generator` is a host one. Enable with `MEGARL_STRICT_DEVICE=1` (read
by `cpu_runtime.activate`) or `enable()` before any model is built.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FAKE_CUDA = torch.device("cuda", 0)
_MARK = "_megarl_on_device"
_ENABLED = False
_GPU_BACKEND: dict = {}  # process group -> "nccl" | "gloo" (what it would be on a GPU)
_LOCAL = threading.local()


class DeviceMismatchError(RuntimeError):
    pass


def enabled() -> bool:
    return _ENABLED


def requested() -> bool:
    return os.environ.get("MEGARL_STRICT_DEVICE", "") not in ("", "0")


def on_device(t) -> bool:
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False  # tensor subclasses (ShardedTensor, DTensor, ...) have no storage of their own
    try:
        return getattr(t.untyped_storage(), _MARK, False)
    except (RuntimeError, NotImplementedError):
        return False


def _mark(out) -> None:
    for t in tree_leaves(out):
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            try:
                setattr(t.untyped_storage(), _MARK, True)
            except (RuntimeError, NotImplementedError):
                pass


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_cpu(device) -> bool:
    return (isinstance(device, str) and device.startswith("cpu")) or (
        isinstance(device, torch.device) and device.type == "cpu")


def _host_copy(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the result of .cpu() / .to("cpu") of `src`) as an unmarked tensor of its own."""
    if out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
        out = out.clone()
    setattr(out.untyped_storage(), _MARK, False)
    return out


_HOST_RESULT = {torch.Tensor.cpu}
_PROPERTIES = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.get_device}


def strict_torch_function(func, args, kwargs, call):
    """Called by the CPU runtime's TorchFunctionMode before it rewrites CUDA devices to CPU.
    Returns (handled, result)."""
    if func in _PROPERTIES and args and on_device(args[0]):
        if func == torch.Tensor.get_device:
            return True, 0
        return True, (FAKE_CUDA if func == torch.Tensor.device.__get__ else True)
    if func is torch.Tensor.numpy and args and on_device(args[0]):
        raise DeviceMismatchError("can't convert a CUDA tensor to numpy: call .cpu() first")
    if func in _HOST_RESULT or (func is torch.Tensor.to and _to_target_is_cpu(args, kwargs)):
        if args and on_device(args[0]):
            return True, _host_copy(args[0], call(func, args, kwargs))
        return False, None
    to_cuda = func is torch.Tensor.cuda or (func is torch.Tensor.to and _to_target_is_cuda(args, kwargs))
    creates = "device" in kwargs and _is_cuda(kwargs["device"])
    if to_cuda or creates:
        out = call(func, args, kwargs)
        if to_cuda and isinstance(out, torch.Tensor) and out is args[0]:
            out = out.clone()  # a real .cuda() copies; the host original stays a host tensor
        _mark(out)
        return True, out
    return False, None


def _to_target(args, kwargs):
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
    return None


def _to_target_is_cuda(args, kwargs) -> bool:
    return _is_cuda(_to_target(args, kwargs))


def _to_target_is_cpu(args, kwargs) -> bool:
    return _is_cpu(_to_target(args, kwargs))


# ops CUDA runs with a host tensor beside device tensors: copies, and host index tensors
_MIXED_OK = frozenset({"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "lift_fresh", "lift_fresh_copy",
                       "set_", "_local_scalar_dense", "index", "index_put", "index_put_", "_index_put_impl_"})


# a copy into a host tensor leaves it a host tensor
_KEEPS_DESTINATION = frozenset({"copy_", "_copy_from", "_copy_from_and_resize", "set_"})


class _StrictDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marked = [t for t in tensors if on_device(t)]
        name = func.overloadpacket.__name__
        if marked and name not in _MIXED_OK:
            # autograd fills an unused empty split's gradient with an untagged zeros((0,)) that its
            # backward then cats (MoE experts that got no token) or sends back through the MoE
            # all-to-all (an EP rank that got no token): no data, no device to get wrong
            host = [t for t in tensors if t.dim() > 0 and not on_device(t)
                    and not (name in ("cat", "alltoall_base_") and t.numel() == 0)]
            if host:
                raise DeviceMismatchError(
                    f"{func}: expected all tensors on the same device, got cuda and cpu tensors "
                    f"(host shapes {[tuple(t.shape) for t in host]}); move them with .to(device())")
        out = func(*args, **kwargs)
        if marked and name not in _KEEPS_DESTINATION:
            _mark(out)
        return out


# ---- collectives ---------------------------------------------------------------------------
_TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "reduce",
                       "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv", "gather", "scatter")
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list")


def gpu_backend(group) -> str:
    """The backend `group` would have on a GPU: gloo when created with backend="gloo"."""
    return _GPU_BACKEND.get(group if group is not None else dist.GroupMember.WORLD, "nccl")


def _check_collective(name: str, args, kwargs) -> None:
    if getattr(_LOCAL, "object_collective", False):
        return  # object collectives place their byte tensors on the right device themselves
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    ops = [a for a in args if isinstance(a, list) and a and isinstance(a[0], dist.P2POp)]
    if ops:
        group = ops[0][0].group
    if gpu_backend(group) != "nccl":
        return
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += [op.tensor for lst in ops for op in lst]
    # an empty tensor is exempt: autograd fills the gradient of an empty output (an EP rank that
    # routed no token to another, the norm under group-limited routing) with zeros in C++, where
    # this mode cannot mark it; on a GPU that tensor is on the output's device
    host = [tuple(t.shape) for t in tensors if not on_device(t) and t.numel()]
    if host:
        raise DeviceMismatchError(f"torch.distributed.{name}: host tensors {host} in a collective of an NCCL group "
                                  "(No backend type associated with device type cpu); use device tensors")


def _wrap_collective(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _check_collective(name, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _wrap_object_collective(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _LOCAL.object_collective = True
        try:
            return fn(*args, **kwargs)
        finally:
            _LOCAL.object_collective = False

    return wrapper


def _wrap_new_group(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = fn(*args, **kwargs)
        backend = kwargs.get("backend") or (args[2] if len(args) > 2 else None)
        if group is not None:
            _GPU_BACKEND[group] = "gloo" if str(backend or "").lower() == "gloo" else "nccl"
        return group

    return wrapper


class _GeneratorType(type):
    """Stands in for torch.Generator: a CUDA generator is a host generator (same calls, same
    isinstance answers)."""

    def __call__(cls, device=None):
        return torch._C.Generator(device="cpu" if _is_cuda(device) or device is None else device)

    def __instancecheck__(cls, obj):
        return isinstance(obj, torch._C.Generator)


def enable() -> None:
    """Turns strict mode on for the life of the process (CPU runtime only)."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("strict device mode is for CPU runs; a GPU is present")
    from torch.distributed import distributed_c10d as c10d

    torch.cuda.current_device = lambda: 0
    torch.Generator = _GeneratorType("Generator", (), {})
    wrappers = {name: _wrap_collective(name, getattr(c10d, name))
                for name in _TENSOR_COLLECTIVES + ("batch_isend_irecv",) if hasattr(c10d, name)}
    wrappers.update({name: _wrap_object_collective(getattr(c10d, name)) for name in _OBJECT_COLLECTIVES
                     if hasattr(c10d, name)})
    wrappers["new_group"] = _wrap_new_group(c10d.new_group)
    for name, fn in wrappers.items():  # both names: P2POp checks its op against c10d.isend / irecv
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    _StrictDispatch().__enter__()  # stays on the dispatch-mode stack for the life of the process
    _ENABLED = True
