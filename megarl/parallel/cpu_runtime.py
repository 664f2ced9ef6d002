"""CPU runtime: lets megatron-core's own TP/PP/DP code run on CPU tensors with gloo.

megatron-core 0.16.1 assumes CUDA in a handful of places (listed below).
`activate()` patches exactly those, process-wide, and only when CUDA is absent:

1. `torch.cuda.current_device()` returns the CPU device, so code that moves buffers "to the
   current device" (RoPE `inv_freq`, the global memory buffer, DDP grad buffers) stays on CPU.
2. A `TorchFunctionMode` rewrites `device="cuda"` / integer device arguments of factory calls
   and `.to()` to CPU, and makes `Tensor.cuda()` return the tensor itself.
3. The model-parallel RNG tracker's CUDA RNG get/set/seed functions use the CPU generator, so
   `model_parallel_cuda_manual_seed` and `get_cuda_rng_tracker().fork()` work (dropout RNG
   therefore differs from GPU runs).
4. Stream/event/synchronize/empty_cache become no-ops (`torch.cuda.Stream`, `Event`, `stream`),
   and so does `Tensor.record_stream` (the MoE alltoall dispatcher records the stream of the
   split sizes it copies to the host).
5. `Tensor.type()` (no arguments) reports CUDA type names ('torch.cuda.FloatTensor'): the
   optimizers and gradient clipping check those names before wrapping parameters or scaling
   grads, and with it megatron's own clipping path (local multi-tensor fallbacks) runs on CPU.

6. Without TE / apex, megatron's distributed optimizer wraps torch's Adam, whose per-param
   state carries a 'step' that megatron 0.16.1's checkpoint code does not expect: its
   `state_dict()` asserts one step value (false on a never-stepped optimizer, e.g. before a
   resume), and the param-state loaders copy every state key from the checkpoint ('step' is
   not saved there; megatron restores it separately, as ONE tensor shared by all params, which
   torch Adam then increments once per param). The patches give a fresh optimizer zero state,
   leave 'step' out of the param-state copy and give every param its own step tensor.

7. `dist.all_to_all_single` gets its split sizes as lists: megatron's MoE alltoall dispatcher
   copies them device -> host as numpy only for CUDA tensors and passes CPU tensors through,
   which the c10d binding rejects (gloo itself supports the variable-size all-to-all).
8. `dist.all_gather` / `reduce_scatter` into differently sized tensors (NCCL does them, gloo
   does not; megatron's MoE dispatcher gathers variable token counts over expert-TP) are padded
   to the largest size, run, and trimmed.
9. `torch.autograd`'s engine run gets the device mode of (2): `backward` is itself a torch
   function, so without it the backward code (the MoE all-to-all's backward) runs unpatched.

The runtime never activates when `torch.cuda.is_available()`; `activate()` raises instead.
`activate(strict=True)` (or MEGARL_STRICT_DEVICE=1) adds strict device mode
(`megarl.parallel.strict_device`): tensors that would live on the GPU are tracked, and code that
would fail on the first GPU step (host tensors into the model, a loss or an NCCL collective)
fails here too.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

from megarl.parallel import strict_device

log = logging.getLogger(__name__)

_ACTIVE = False
_CPU = torch.device("cpu")


def is_active() -> bool:
    return _ACTIVE


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function / tensor method (and, in
    strict device mode, marks what would live on the GPU: `megarl.parallel.strict_device`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if strict_device.enabled():
            handled, out = strict_device.strict_torch_function(func, args, kwargs, self._call)
            if handled:
                return out
        return self._call(func, args, kwargs)

    @staticmethod
    def _call(func, args, kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.cuda:
            return args[0]
        if getattr(func, "__name__", "") == "all_gather" and _uneven(args, kwargs):
            return _all_gather_uneven(func, *args, **kwargs)
        if getattr(func, "__name__", "") == "reduce_scatter" and _uneven(args[1:], {"tensor_list": kwargs.get("input_list")}):
            return _reduce_scatter_uneven(*args, **kwargs)
        if func is torch.distributed.all_to_all_single:
            kwargs = {k: v.tolist() if k.endswith("split_sizes") and torch.is_tensor(v) else v
                      for k, v in kwargs.items()}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron checks type names like 'torch.cuda.FloatTensor' before wrapping params
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _uneven(args, kwargs) -> bool:
    out = args[0] if args else kwargs.get("tensor_list")
    return isinstance(out, (list, tuple)) and len({tuple(t.shape) for t in out}) > 1


def _all_gather_uneven(all_gather, tensor_list, tensor, group=None, async_op=False):
    """all_gather into differently sized tensors (NCCL supports it, gloo does not; megatron's MoE
    dispatcher gathers variable token counts over expert-TP): pads to the largest, gathers, trims."""
    n = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((n, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    bufs = [tensor.new_empty((n, *tensor.shape[1:])) for _ in tensor_list]
    all_gather(bufs, padded, group=group)
    for t, b in zip(tensor_list, bufs):
        t.copy_(b[: t.shape[0]])
    return None


def _reduce_scatter_uneven(output, input_list, op=None, group=None, async_op=False):
    """reduce_scatter (sum) of differently sized chunks (the backward of `_all_gather_uneven`):
    chunks padded to the largest and stacked, all-reduced, this rank's chunk trimmed."""
    n = max(t.shape[0] for t in input_list)
    stacked = output.new_zeros((len(input_list), n, *output.shape[1:]))
    for i, t in enumerate(input_list):
        stacked[i, : t.shape[0]] = t
    torch.distributed.all_reduce(stacked, group=group)
    output.copy_(stacked[torch.distributed.get_rank(group), : output.shape[0]])
    return None


class _NoopStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoopEvent()

    def synchronize(self):
        pass


class _NoopEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_get_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _NoopStream
    cuda.Event = _NoopEvent
    cuda.current_stream = lambda *a, **k: _NoopStream()
    cuda.default_stream = lambda *a, **k: _NoopStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_device = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, stream: None  # its arg parser rejects _NoopStream
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed already seeded the CPU generator
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0


def _patch_autograd_engine() -> None:
    """`torch.autograd.backward` is a torch function: it runs inside the mode's handler, where the
    mode is off, so backward code (megatron's MoE all-to-all backward: CUDA device arguments,
    tensor split sizes) would run without it. The engine run gets a mode of its own."""
    import torch.autograd as autograd

    run = autograd._engine_run_backward

    def engine_run_backward(*args, **kwargs):
        if torch._C._is_torch_function_mode_enabled():
            return run(*args, **kwargs)
        with _CudaToCpuMode():
            return run(*args, **kwargs)

    autograd._engine_run_backward = engine_run_backward


def _patch_megatron() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _cpu_get_rng_state
    mp_random._set_cuda_rng_state = _cpu_set_rng_state

    state_dict = DistributedOptimizer.state_dict
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def state_dict_with_adam_state(self):
        _materialize_adam_state(self.optimizer)
        return state_dict(self)

    def set_states_without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                # megatron restores one shared 'step' tensor for all params; torch Adam
                # increments it in place per param, so each param needs its own copy
                state["step"] = step.clone()

    DistributedOptimizer.state_dict = state_dict_with_adam_state
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_step


def _materialize_adam_state(opt) -> None:
    """Zero moments and step 0 for torch Adam params that have no state yet."""
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0)
                st.setdefault("exp_avg", torch.zeros_like(p.data))
                st.setdefault("exp_avg_sq", torch.zeros_like(p.data))


def activate(strict: bool | None = None) -> None:
    """Installs the CPU runtime process-wide. Idempotent. Raises if CUDA is available.

    strict (default: env MEGARL_STRICT_DEVICE) also turns on strict device mode."""
    _activate()
    if strict if strict is not None else strict_device.requested():
        strict_device.enable()


def _activate() -> None:
    global _ACTIVE
    if _ACTIVE:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megarl CPU runtime must not be activated when CUDA is available")
    _patch_torch_cuda()
    _patch_megatron()
    _patch_autograd_engine()
    mode = _CudaToCpuMode()
    mode.__enter__()  # stays on the mode stack for the life of the process
    _ACTIVE = True
    log.info("megarl CPU runtime active: megatron-core runs on CPU tensors with gloo")


def requires_cpu_runtime(fn):
    """Decorator for tests/tools: activates the runtime when no GPU is present."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.cuda.is_available():
            activate()
        return fn(*args, **kwargs)

    return wrapper
