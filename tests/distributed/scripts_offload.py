"""Worker for tests/distributed/test_offload.py: TrainModel.offload / onload under strict device
mode with its host-offload model (megarl.parallel.host_offload), 2 gloo ranks (DP=2).

For each optimizer setup two models are built from the same weights: one goes through
offload -> onload before every train step (as in the RL loop: one round trip per rollout), its
twin never leaves the device. Recorded per case, after every step: the largest difference
between the twins' forward log-probs, how much the offloaded model's forward moved, and after
each offload the device bytes its weights still hold; an exception ends the case and is recorded
(every rank runs the same code, so every rank raises it).
"""

import dataclasses
import random
import types

import torch

from megarl.config import load_config
from megarl.config.schema import OptimConfig
from megarl.parallel import host_offload, strict_device
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.trainer import offload
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import load_hf_config_and_tokenizer
from megarl.trainer.components import RunComponents
from megarl.trainer.metrics import PhaseTimer
from megarl.trainer.train_model import TrainModel
from megarl.weights import load_hf_weights, stream_hf_weights
from tests.distributed.harness import finish, parse_args, train_model
from tools.smoke.offload import accumulators_kept, main_grad_norm

CASES = {  # name -> (model dtype, OptimConfig fields)
    "hybrid_bf16": ("bf16", {"use_distributed_optimizer": True, "offload_optimizer": True}),
    "distributed_fp32": ("fp32", {"use_distributed_optimizer": True}),
    "distributed_bf16": ("bf16", {"use_distributed_optimizer": True}),
    "plain_bf16": ("bf16", {"use_distributed_optimizer": False}),
    "plain_fp32": ("fp32", {"use_distributed_optimizer": False}),
}


def batch() -> StepBatch:
    rng = random.Random(0)
    trajs = []
    for i in range(4):
        r = [rng.randrange(3, 100) for _ in range(rng.randint(3, 6))]
        trajs.append(Trajectory(str(i), [rng.randrange(3, 100) for _ in range(4)], r, [0.0] * len(r), "stop"))
    return StepBatch.from_trajectories(trajs)


def nll(n_tokens: float):
    def loss_fn(mb, output):
        loss = -(mb.log_probs(output) * mb.data.response_mask).sum() / n_tokens
        return loss, {"nll": loss.detach()}

    return loss_fn


def logprobs(model, b) -> torch.Tensor:
    return model.forward_only(b, lambda mb, out: mb.log_probs(out))


def weights(model) -> list:
    return [p for m in model.modules for p in m.parameters()]


def optimizer_param_storage(model) -> dict:
    """Bytes of device storage held by the optimizer's parameters that are not inside a DDP
    parameter buffer (with the distributed optimizer's fp32 shards: a duplicate of the weights)."""
    in_buffer = {b.param_data.untyped_storage().data_ptr() for c in model.chunks for b in c.buffers
                 if b.param_data is not None}
    own = [p for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer])
           for g in opt.optimizer.param_groups for p in g["params"]
           if strict_device.on_device(p) and p.untyped_storage().data_ptr() not in in_buffer]
    viewing = sum(1 for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer])
                  for g in opt.optimizer.param_groups for p in g["params"]
                  if p.untyped_storage().data_ptr() in in_buffer)
    return {"own_device_bytes": host_offload.device_bytes(own), "views_of_buffer": viewing}


def run_case(model_dir: str, hf_config, dtype: str, fields: dict, steps: int = 3) -> dict:
    optim = dataclasses.replace(OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0, max_tokens_per_microbatch=32),
                                **fields)
    offloaded, twin = (train_model(hf_config, optim, model_dir, dtype=dtype, total_steps=10, seed=0) for _ in range(2))
    res = {"twin_diff": [], "forward_moved": [], "device_bytes_offloaded": [], "roundtrip_equal": [],
           "device_bytes_before": host_offload.device_bytes(weights(offloaded)), "optimizer_params": [],
           "error": None}
    try:
        round_trips(offloaded, twin, steps, res)
    except Exception as e:  # recorded: the steps before it still say what went wrong first
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    return res


def round_trips(offloaded, twin, steps: int, res: dict) -> None:
    b = batch()
    loss = nll(float(b.response_mask.sum()))
    res["accumulators_kept"], res["main_grad_norm"] = [], []
    for _ in range(steps):
        before = [p.detach().cpu().clone() for p in weights(offloaded)]
        offloaded.offload()
        res["device_bytes_offloaded"].append(host_offload.device_bytes(weights(offloaded)))
        offloaded.onload()
        res["roundtrip_equal"].append(all(torch.equal(a, p.detach().cpu()) and strict_device.on_device(p)
                                          for a, p in zip(before, weights(offloaded))))
        res["optimizer_params"].append(optimizer_param_storage(offloaded))
        res["accumulators_kept"].append(accumulators_kept(offloaded))
        start = logprobs(offloaded, b)
        offloaded.train_step(b, loss)
        res["main_grad_norm"].append(main_grad_norm(offloaded))
        twin.train_step(b, loss)
        after = logprobs(offloaded, b)
        res["forward_moved"].append(float((after - start).abs().max()))
        res["twin_diff"].append(float((after - logprobs(twin, b)).abs().max()))


def reference_case(model_dir: str, hf_config) -> dict:
    """A forward-only model (no DDP, no optimizer): its parameters leave and come back."""
    m = TrainModel(hf_config, None, dtype="fp32", seed=0)
    load_hf_weights(m.chunks, model_dir)
    b = batch()
    start = logprobs(m, b)
    m.offload()
    off = host_offload.device_bytes(weights(m))
    m.onload()
    return {"device_bytes_offloaded": off, "forward_equal": bool(torch.equal(start, logprobs(m, b)))}


def footprint(model) -> dict:
    """Device bytes of the model's weights, gradients and optimizer tensors (megarl.trainer.offload's
    split; an optimizer parameter that is a weight counts as a weight)."""
    w = offload.weight_tensors(model.chunks)
    keys = {t.untyped_storage()._cdata for t in w}
    opt = [p for p in offload.optimizer_params(model.optimizer) if p.untyped_storage()._cdata not in keys]
    return {"weights": host_offload.device_bytes(w),
            "grads": host_offload.device_bytes(offload.gradient_tensors(model.chunks, model.optimizer)),
            "optimizer": host_offload.device_bytes(opt + offload.optimizer_state_tensors(model.optimizer))}


class WatchedEngine(BuiltinEngine):
    """The builtin engine, recording the trainer's device footprint when each bucket arrives."""

    def __init__(self, watch, **kwargs):
        super().__init__(**kwargs)
        self.watch, self.seen = watch, []

    def update_weights(self, stream, strict: bool = True) -> None:
        def watched():
            for bucket in stream:
                self.seen.append(self.watch())
                yield bucket

        super().update_weights(watched(), strict)


def sync_case(model_dir: str, hf_config, fields: dict, from_host: bool = False) -> dict:
    """RunComponents.sync_weights and generation with rollout.offload_train_state=true (from_host:
    and rollout.sync_from_host), as the loop runs them after a training step: the device footprint
    of the actor (and of a forward-only reference model) before, during the weight stream, in
    generation and after; then a step that must equal a twin's that never offloaded."""
    cfg = load_config(None, ["rollout.engine=builtin", "rollout.offload_train_state=true", "rollout.weight_bucket_mb=1",
                             "model.dtype=bf16", f"rollout.sync_from_host={str(from_host).lower()}"])
    optim = dataclasses.replace(OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0, max_tokens_per_microbatch=32),
                                **fields)
    actor, twin = (train_model(hf_config, optim, model_dir, dtype="bf16", total_steps=10, seed=0) for _ in range(2))
    ref = TrainModel(hf_config, None, dtype="bf16", seed=0)
    load_hf_weights(ref.chunks, model_dir)
    watch = lambda: {"actor": footprint(actor), "ref_weights": host_offload.device_bytes(weights(ref))}  # noqa: E731
    engine = WatchedEngine(watch, config=hf_config, tokenizer=None, device=device(), dtype=torch.bfloat16)
    run = RunComponents(cfg=cfg, hf_config=hf_config, actor=actor, critic=None, ref=ref, engine=engine,
                        worker=types.SimpleNamespace(policy_version=None), data=None, logger=None,
                        timer=PhaseTimer(), dp_group=None, dp_rank=0, dp_size=1)
    b = batch()
    loss = nll(float(b.response_mask.sum()))
    for m in (actor, twin):
        m.train_step(b, loss)
    res = {"trained": watch()}
    run.sync_weights(1)
    res["stream"], res["after_sync"] = engine.seen, watch()
    with run.generation(release=True):
        res["generation"] = watch()
    res["after_generation"] = watch()
    streamed = {n: t for bucket in stream_hf_weights(actor.modules, hf_config) for n, t in bucket}
    engine.resume_memory()
    mine = dict(engine.model.named_parameters())
    res["engine_equal"] = all(torch.equal(mine[engine._param_key(n)].cpu(), t.cpu()) for n, t in streamed.items()
                              if engine._param_key(n) is not None)
    for m in (actor, twin):
        m.train_step(b, loss)
    res["twin_diff"] = float((logprobs(actor, b) - logprobs(twin, b)).abs().max())
    return res


def smoke_check(model_dir: str, hf_config) -> dict:
    """tools/gpu_smoke.py's `offload_plain` check (tools/smoke/offload.py), here on the CPU model."""
    from tools.smoke.offload import round_trip_check

    optim = OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0, max_tokens_per_microbatch=32,
                        use_distributed_optimizer=False)
    b = batch()
    try:
        detail = round_trip_check(
            lambda: train_model(hf_config, optim, model_dir, dtype="bf16", total_steps=10, seed=0),
            b, nll(float(b.response_mask.sum())))
        return {"ok": True, "detail": detail}
    except ValueError as e:
        return {"ok": False, "detail": str(e)}


def model_checks() -> dict:
    """The host-offload model itself: device <-> host moves copy, pinning is a host copy."""
    dev = torch.ones(4, device="cuda")
    host = dev.cpu()
    back = host.cuda()
    err = None
    try:
        dev.pin_memory()
    except strict_device.DeviceMismatchError as e:
        err = str(e)
    pinned = torch.empty(4, pin_memory=True)
    return {"cpu_is_host_copy": not strict_device.on_device(host) and host.data_ptr() != dev.data_ptr(),
            "cuda_is_device_copy": strict_device.on_device(back) and back.data_ptr() != host.data_ptr(),
            "pin_host_copy": host.pin_memory().data_ptr() != host.data_ptr(),
            "pin_device_error": err, "pinned_factory_on_host": not strict_device.on_device(pinned)}


def main() -> None:
    args = parse_args(cases=",".join(CASES), sync="distributed_bf16,plain_bf16,distributed_bf16_from_host,plain_bf16_from_host")
    model = str(args.root / "model")
    init_distributed(ParallelSizes(), seed=0, timeout_s=300)
    host_offload.enable()
    hf_config, _ = load_hf_config_and_tokenizer(model)
    res = {name: run_case(model, hf_config, *CASES[name]) for name in args.cases.split(",") if name}
    res["reference"] = reference_case(model, hf_config)
    res["smoke_offload_plain"] = smoke_check(model, hf_config)
    for name in args.sync.split(","):
        if name:
            base = name.removesuffix("_from_host")
            res[f"sync_{name}"] = sync_case(model, hf_config, CASES[base][1], from_host=name != base)
    try:
        TrainModel(hf_config, OptimConfig(offload_optimizer=True), dtype="fp32")
        res["hybrid_fp32_refused"] = None
    except ValueError as e:
        res["hybrid_fp32_refused"] = str(e)
    res["model"] = model_checks()
    finish(args.out, res)


if __name__ == "__main__":
    main()
