"""Process-group setup: nccl + CUDA when a GPU is present, gloo + the CPU runtime otherwise."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megarl.parallel import cpu_runtime


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


def init_distributed(parallel=None, seed: int = 1234, timeout_minutes: int = 30) -> ParallelSizes:
    """Initialises torch.distributed and megatron-core parallel_state.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (torchrun); a
    single process without them gets world size 1. On CPU it activates the CPU runtime and uses
    gloo; context and expert parallelism need TE/GPU and are rejected there.
    """
    from megatron.core import parallel_state

    sizes = _sizes(parallel)
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_runtime.activate()
        if sizes.cp > 1:
            raise ValueError("parallel.cp > 1 needs Transformer Engine on GPU; set parallel.cp=1 on CPU")
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=timeout_minutes)
        )
    world = dist.get_world_size()
    model_parallel = sizes.tp * sizes.pp * sizes.cp
    if world % model_parallel:
        raise ValueError(
            f"parallel.tp*pp*cp = {sizes.tp}*{sizes.pp}*{sizes.cp} = {model_parallel} "
            f"does not divide the world size {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)
    return sizes


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device training tensors live on for this rank (CUDA; on CPU the host, or the
    strict device mode's stand-in for CUDA)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from megarl.parallel import strict_device

    return strict_device.FAKE_CUDA if strict_device.enabled() else torch.device("cpu")
