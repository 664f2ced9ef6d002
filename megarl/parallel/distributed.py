"""Process-group setup: nccl + CUDA when a GPU is present, gloo + the CPU runtime otherwise.

Lost ranks: every collective of the world and megatron's groups times out after
`parallel.collective_timeout_s`. `phase(name)` names what a rank is doing (the trainer's timed
phases, reward, eval, checkpoint writes); a collective that fails inside it (a peer died: gloo
sees its socket close at once; a peer hangs or its node vanished: the timeout fires) is re-raised
as `CollectiveError` naming the phase, so the job ends and a scheduler can requeue it with
trainer.resume=true. With NCCL on GPU the watchdog aborts the process after the same timeout;
faulthandler (enabled here) then prints every thread's Python stack, whose trainer frames show
the phase.

Fault injection (tests and tools/bench/chaos.py only; both unset in normal runs):
MEGARL_CHAOS_KILL_AT="<phase>:<n>[@<rank>][:<SIGNAL>|:node]" sends SIGKILL (or SIGNAL, e.g.
SIGSTOP) to this process at the n-th entry of `phase` / `fault_point` <phase> (only on rank
<rank> when given); `node` first SIGKILLs the torchrun agent that started this rank and all its
other processes (a lost node). Several specs are separated by commas. MEGARL_CHAOS_LOG=<prefix> appends every entry
("<phase> <n>") and every return to an outer phase ("<phase>") to <prefix>.rank<R>.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megarl.parallel import cpu_runtime
from megarl.parallel.launch import free_port


@dataclass
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    etp: int | None = None


def _sizes(parallel) -> ParallelSizes:
    if parallel is None:
        return ParallelSizes()
    if isinstance(parallel, ParallelSizes):
        return parallel
    parallel = getattr(parallel, "parallel", parallel)  # accept the whole config tree
    return ParallelSizes(
        tp=getattr(parallel, "tp", 1),
        pp=getattr(parallel, "pp", 1),
        cp=getattr(parallel, "cp", 1),
        ep=getattr(parallel, "ep", 1),
        vpp=getattr(parallel, "vpp", None),
        etp=getattr(parallel, "etp", None),
    )


def seed_everything(seed: int) -> None:
    """Seeds python, numpy, torch and megatron's model-parallel RNG tracker (after mpu init)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(seed)


DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


def init_distributed(parallel=None, seed: int = 1234, timeout_s: float | None = None) -> ParallelSizes:
    """Initialises torch.distributed and megatron-core parallel_state.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (torchrun); a
    single process without them gets world size 1. On CPU it activates the CPU runtime and uses
    gloo. Collectives time out after `timeout_s` (default: `parallel.collective_timeout_s` of
    the config passed, else 30 min); the world group keeps the timeout of its first init.
    """
    from megatron.core import parallel_state

    sizes = _sizes(parallel)
    if timeout_s is None:
        section = getattr(parallel, "parallel", parallel)
        timeout_s = float(getattr(section, "collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S))
    global _TIMEOUT_S
    _TIMEOUT_S = timeout_s
    if not faulthandler.is_enabled():
        faulthandler.enable()  # an NCCL watchdog abort still prints where each thread was
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_runtime.activate()
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    world = dist.get_world_size()
    model_parallel = sizes.tp * sizes.pp * sizes.cp
    if world % model_parallel:
        raise ValueError(
            f"parallel.tp*pp*cp = {sizes.tp}*{sizes.pp}*{sizes.cp} = {model_parallel} "
            f"does not divide the world size {world}"
        )
    expert_parallel = (sizes.etp or sizes.tp) * sizes.ep * sizes.pp
    if world % expert_parallel:
        raise ValueError(
            f"parallel.etp*ep*pp = {sizes.etp or sizes.tp}*{sizes.ep}*{sizes.pp} = {expert_parallel} "
            f"does not divide the world size {world} (experts are split over the data-parallel ranks)")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        distributed_timeout_minutes=timeout_s / 60,
    )
    global _HOST_GROUP
    # rollout data moves over gloo, never through the GPU (megarl.parallel.exchange)
    _HOST_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world > 1 else None
    seed_everything(seed)
    return sizes


_HOST_GROUP = None


def host_group():
    """The gloo group of the whole world made by `init_distributed` (None: one process)."""
    return _HOST_GROUP


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    global _HOST_GROUP
    _HOST_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    """The device training tensors live on for this rank (CUDA; on CPU the host, or the
    strict device mode's stand-in for CUDA)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from megarl.parallel import strict_device

    return strict_device.FAKE_CUDA if strict_device.enabled() else torch.device("cpu")


# ---- phases, lost ranks, fault injection ---------------------------------------------------
class CollectiveError(RuntimeError):
    """A collective failed or timed out inside a named phase: a peer rank died or hangs."""


_TIMEOUT_S = DEFAULT_COLLECTIVE_TIMEOUT_S
_PHASES: list[str] = []
_ENTRIES: dict[str, int] = {}
# what gloo's RuntimeErrors say about a peer that closed its socket or did not answer in time
_FAILURE_TEXT = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                 "Broken pipe")


def current_phase() -> str:
    return _PHASES[-1] if _PHASES else "outside a named phase"


@contextlib.contextmanager
def phase(name: str):
    """Names what this rank does meanwhile (nestable). A collective failure inside becomes a
    `CollectiveError` naming the innermost phase; entering is a `fault_point`."""
    _PHASES.append(name)
    fault_point(name)
    try:
        yield
    except Exception as e:
        if isinstance(e, CollectiveError) or not is_collective_failure(e):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"rank {rank}: a collective failed during phase {name!r} ({' > '.join(_PHASES)}): another rank died "
            f"or did not answer within parallel.collective_timeout_s={_TIMEOUT_S:g}; resume the job with "
            f"trainer.resume=true. Cause: {e}") from e
    finally:
        _PHASES.pop()
        _chaos_log(current_phase())


def is_collective_failure(e: BaseException) -> bool:
    """torch.distributed errors (NCCL's are DistBackendError), and the RuntimeErrors gloo raises
    for a closed peer or a timeout."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(t in str(e) for t in _FAILURE_TEXT))


def fault_point(name: str) -> None:
    """Counts an entry of `name`; MEGARL_CHAOS_KILL_AT may signal this process here (module doc)."""
    n = _ENTRIES[name] = _ENTRIES.get(name, 0) + 1
    _chaos_log(f"{name} {n}")
    spec = os.environ.get("MEGARL_CHAOS_KILL_AT")
    if not spec:
        return
    rank = int(os.environ.get("RANK", "0"))
    for item in spec.split(","):
        where, _, sig = item.partition(":")[2].partition(":")
        count, _, only_rank = where.partition("@")
        if item.split(":")[0] == name and int(count) == n and (not only_rank or int(only_rank) == rank):
            sys.stderr.write(f"MEGARL_CHAOS_KILL_AT: {sig or 'SIGKILL'} rank {rank} at {name} {n}\n")
            sys.stderr.flush()
            if sig == "node":
                _kill_node_job()
            os.kill(os.getpid(), getattr(signal, sig if sig and sig != "node" else "SIGKILL"))


def _kill_node_job() -> None:
    """SIGKILLs the torchrun agent of this rank and the agent's other descendants."""
    import psutil

    me = psutil.Process()
    agent = me.parent()
    if agent is None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    for p in [agent, *(c for c in agent.children(recursive=True) if c.pid != me.pid)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _chaos_log(line: str) -> None:
    prefix = os.environ.get("MEGARL_CHAOS_LOG")
    if prefix:
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(line + "\n")
