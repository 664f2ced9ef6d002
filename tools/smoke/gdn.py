"""The `gdn_kernels` check of tools/gpu_smoke.py: the gated delta-net kernels on the device.

A packed row of three sequences (lengths 70, 5 and 133: one under a chunk, two over) of random
delta-net inputs; the reference is the torch kernel in float32 on the CPU
(`megarl.models.gdn_kernels`: the causal convolution and the chunked delta rule). On the device:

- the torch kernel in float32 (index tensors, positions and padding built on the device) must equal
  the reference within `TORCH_TOL` (relative);
- on CUDA with flash-linear-attention installed, its kernels in bf16 (`fla_causal_conv1d`,
  `fla_gated_delta_rule`: megarl's argument contract is asserted before each call) must be within
  `FLA_TOL` of the reference, and the third sequence's outputs must not move when the first
  sequence's inputs change (the state restarts at every boundary of `cu_seqlens`).

Without flash-linear-attention the check says so in its detail (the torch kernel still ran on the
device). Run on CPU by tests/unit/test_gpu_tools.py through `gpu_smoke --only gdn_kernels`.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.smoke.gdn`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/smoke/
    __import__("tools").run_as_module(__file__)

TORCH_TOL = 1e-4  # float32 on two devices: summation order only
FLA_TOL = 3e-2  # bf16 inputs and outputs against float32
LEAK_TOL = 1e-3  # a restarted state leaves the third sequence as it was (bf16 noise at most)
LENGTHS = (70, 5, 133)
HEADS, DK, DV, CONV = 4, 32, 48, 4


def inputs(seed: int = 0) -> dict:
    """CPU float32 inputs of one packed row: conv input x [T, C] and weight [C, K], then q, k [T, H, d_k],
    v [T, H, d_v], g (log decay, <= 0) and beta in (0, 1) [T, H]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {"x": r(t, 2 * HEADS * DK + HEADS * DV), "w": r(2 * HEADS * DK + HEADS * DV, CONV) * 0.5,
            "q": r(t, HEADS, DK), "k": r(t, HEADS, DK), "v": r(t, HEADS, DV),
            "g": -torch.rand(t, HEADS, generator=gen) * 0.5, "beta": torch.rand(t, HEADS, generator=gen)}


def run(kernel: str, x: dict, device, dtype) -> tuple:
    """(conv output, delta-rule output) of `kernel` ("torch" or "fla"), as float32 on the CPU."""
    import torch

    from megarl.models import gdn_kernels as K

    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    d = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    if kernel == "fla":
        cu_dev = torch.tensor(cu, dtype=torch.long, device=device)
        conv = K.fla_causal_conv1d(d["x"], d["w"], cu_dev)
        o = K.fla_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_dev)
    else:
        conv = K.causal_conv1d_packed(d["x"], d["w"], cu)
        o, _ = K.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], cu)
    return conv.float().cpu(), o.float().cpu()


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def gdn_check(device: str) -> dict:
    """Errors of the device's kernels against the CPU float32 reference (module doc); `fla` None
    where flash-linear-attention cannot run here."""
    import torch

    from megarl.models import gdn_kernels as K

    x = inputs()
    ref_conv, ref_o = run("torch", x, "cpu", torch.float32)
    conv, o = run("torch", x, device, torch.float32)
    out = {"torch_conv": rel(conv, ref_conv), "torch_rule": rel(o, ref_o), "fla": None}
    if device == "cuda" and K.fla_functions() is not None:
        conv, o = run("fla", x, device, torch.bfloat16)
        moved = dict(x)
        for key in ("x", "q", "k", "v"):
            moved[key] = x[key].clone()
            moved[key][: LENGTHS[0]] += 1.0
        conv2, o2 = run("fla", moved, device, torch.bfloat16)
        third = slice(LENGTHS[0] + LENGTHS[1], None)
        out.update(fla=True, fla_conv=rel(conv, ref_conv), fla_rule=rel(o, ref_o),
                   fla_leak=float(max((conv2[third] - conv[third]).abs().max(), (o2[third] - o[third]).abs().max())))
    return out


def problems(errs: dict) -> list[str]:
    bad = [f"{k} {errs[k]:.3g} > {TORCH_TOL}" for k in ("torch_conv", "torch_rule") if not errs[k] <= TORCH_TOL]
    if errs["fla"]:
        bad += [f"{k} {errs[k]:.3g} > {FLA_TOL}" for k in ("fla_conv", "fla_rule") if not errs[k] <= FLA_TOL]
        if not errs["fla_leak"] <= LEAK_TOL:
            bad.append(f"fla: the third sequence moved by {errs['fla_leak']:.3g} when the first changed")
    return bad


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    p = argparse.ArgumentParser(description="The gated delta-net kernels on this machine's device against "
                                            "the CPU float32 reference (module doc).")
    p.parse_args(argv)
    errs = gdn_check("cuda" if torch.cuda.is_available() else "cpu")
    bad = problems(errs)
    print(("FAIL " + "; ".join(bad) + " | " if bad else "PASS ") + str(errs))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
