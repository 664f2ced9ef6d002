"""The `offload_plain` check of tools/gpu_smoke.py: offload without the distributed optimizer.

Without `actor.use_distributed_optimizer` megatron DDP has no parameter buffer and megarl moves
each parameter itself (megarl/trainer/offload.py). Moving it by `p.data = p.data.cpu()` resets
the parameter's gradient accumulator on a GPU (torch's set_data, when the device changes), and
DDP's grad hook (which fills `main_grad`) hangs on the old one: the optimizer then steps on zero
gradients. This check runs what the loop runs, on a model and a twin that never offloads:

- a full round trip (`offload()` -> `onload()`), then the two-stage one of the weight sync
  (`offload(weights=False)`: gradients and optimizer state; `offload()`: the weights; `onload()`);
- after each: every trained parameter's gradient accumulator is still the one DDP hooked,
  the next step's `main_grad` is non-zero and its norm (the step's grad_norm, before clipping)
  equals the twin's, and device memory
  fell at each stage;
- at the end the weights equal the twin's (|W - W_twin| / |W_twin - W_start| under `tol_rel`).

It runs on CPU too, in strict device mode with megarl.parallel.host_offload enabled (device bytes
counted from the model's tensors instead of the GPU allocator): tests/distributed/test_offload.py.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.smoke.offload`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/smoke/
    __import__("tools").run_as_module(__file__)

from typing import Callable

# |main_grad norm - twin's| / twin's after a round trip: the same kernels on the same inputs (bf16)
GRAD_NORM_TOL = 1e-2


def accumulators_kept(model) -> bool:
    """Whether every trained parameter's gradient accumulator is still one that megatron DDP hung
    its grad hook on (`grad_accs`)."""
    for chunk in model.chunks:
        hooked = {id(acc) for acc in chunk.grad_accs}
        for p in chunk.module.parameters():
            if p.requires_grad and id(p.expand_as(p).grad_fn.next_functions[0][0]) not in hooked:
                return False
    return True


def main_grad_norm(model) -> float:
    return float(sum(float(p.main_grad.float().norm()) ** 2 for c in model.chunks
                     for p in c.module.parameters() if p.requires_grad) ** 0.5)


def device_bytes(model) -> int:
    """The GPU allocator's bytes on a GPU; on CPU (host_offload) the model's device tensors."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    from megarl.parallel import host_offload
    from megarl.trainer import offload

    return host_offload.device_bytes(offload.weight_tensors(model.chunks)
                                     + offload.gradient_tensors(model.chunks, model.optimizer)
                                     + offload.optimizer_params(model.optimizer)
                                     + offload.optimizer_state_tensors(model.optimizer))


def _weights(model) -> dict:
    return {n: p.detach().float().cpu().clone() for m in model.modules for n, p in m.named_parameters()}


def _norm(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5


def round_trip_check(make_model: Callable, batch, loss_fn, tol_rel: float = 0.1) -> str:
    """Raises ValueError on a failure; returns the detail line. `make_model()` builds a TrainModel
    (same weights every call) whose optimizer is not the distributed one."""
    a, twin = make_model(), make_model()
    if a.optim_cfg.use_distributed_optimizer:
        raise ValueError("offload_plain needs use_distributed_optimizer=false")
    start = _weights(twin)
    for m in (a, twin):  # Adam state and main_grad exist
        m.train_step(batch, loss_fn)
    notes = []
    for two_stage in (False, True):
        before = device_bytes(a)
        if two_stage:
            a.offload(weights=False)
            mid = device_bytes(a)
        a.offload()
        off = device_bytes(a)
        a.onload()
        label = "two-stage" if two_stage else "full"
        if not accumulators_kept(a):
            raise ValueError(f"{label} round trip: a parameter's gradient accumulator is not the one DDP hooked "
                             "(its .data was assigned across devices): main_grad will stay zero")
        g = a.train_step(batch, loss_fn)["grad_norm"]  # of main_grad, before clipping
        g_twin = twin.train_step(batch, loss_fn)["grad_norm"]
        if not (g > 0 and main_grad_norm(a) > 0) or abs(g - g_twin) > GRAD_NORM_TOL * g_twin:
            raise ValueError(f"{label} round trip: gradient norm {g:.4g} after it (main_grad norm "
                             f"{main_grad_norm(a):.4g}), twin {g_twin:.4g}")
        freed = f"{(before - off) / 2**20:.2f} MiB freed"
        if two_stage:
            if not (before > mid > off):
                raise ValueError(f"two-stage offload: device bytes {before} -> {mid} (state) -> {off} (weights): "
                                 "each stage must free memory")
            freed = f"state {(before - mid) / 2**20:.2f} + weights {(mid - off) / 2**20:.2f} MiB freed"
        elif not before > off:
            raise ValueError(f"offload freed no device memory ({before} -> {off} bytes)")
        notes.append(f"{label}: {freed}, next step's grad norm {g:.4g} (twin {g_twin:.4g})")
    rel = _norm(_weights(a), _weights(twin)) / max(_norm(_weights(twin), start), 1e-30)
    if rel > tol_rel:
        raise ValueError(f"weights after the round trips differ from the twin's: |dW| / |update| {rel:.3g} > {tol_rel}")
    return ("use_distributed_optimizer=false: DDP's gradient accumulators kept; " + "; ".join(notes)
            + f"; vs twin |dW|/|update| {rel:.3g}")


def main(argv: list[str] | None = None) -> int:
    """A check of gpu_smoke, not a tool of its own: says how to run it."""
    import argparse

    argparse.ArgumentParser(prog="python -m tools.smoke.offload", description=__doc__.splitlines()[0]
                            + " Run it as: python -m tools.gpu_smoke --only offload_plain").parse_args(argv)
    print("python -m tools.gpu_smoke --only offload_plain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
