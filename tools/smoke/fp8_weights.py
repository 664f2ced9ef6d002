"""The `fp8_weights` check of tools/gpu_smoke.py: FP8 rollout weights (rollout.weights_dtype=fp8)
quantized and dequantized on the device.

One bucket of bf16 tensors on the device as the weight stream yields them (linear weights with
edge blocks, a router gate, a norm) goes through `megarl.weights.fp8_blocks.quantized_stream` and
back through `dequantized_stream` (what the builtin engine does with the stream). Checked:

- the linear weights leave as float8_e4m3fn with float32 `_scale_inv` blocks, on the device they
  came from; the gate and the norm pass unchanged;
- each dequantized weight is within block-FP8 rounding of the bf16 one (relative Frobenius error
  <= `ROUND_TOL`; e4m3 keeps 3 mantissa bits);
- the device's FP8 values and scales equal the CPU's for the same input (relative <= `DEVICE_TOL`):
  the engine sees the same weights whichever device quantized them.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.smoke.fp8_weights`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/smoke/
    __import__("tools").run_as_module(__file__)

ROUND_TOL = 0.05
DEVICE_TOL = 1e-3
SHAPES = {"model.layers.0.self_attn.q_proj.weight": (200, 130), "model.layers.0.mlp.down_proj.weight": (256, 384),
          "model.layers.0.mlp.gate.weight": (8, 256), "model.layers.0.input_layernorm.weight": (256,)}
QUANTIZED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")


def bucket(device) -> list:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [(n, (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16).to(device)) for n, s in SHAPES.items()]


def round_trip(device) -> tuple[dict, dict]:
    """({name: tensor} of the quantized bucket, {name: dequantized float32 tensor}), on `device`."""
    from megarl.weights.fp8_blocks import dequantized_stream, quantized_stream

    quantized = next(quantized_stream([bucket(device)]))
    back = next(dequantized_stream([quantized]))
    return dict(quantized), dict(back)


def rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def fp8_weights_check(device: str) -> tuple[dict, list[str]]:
    """(numbers, problems) of the module doc's checks on `device`."""
    import torch

    src = dict(bucket("cpu"))
    q, back = round_trip(device)
    q_cpu, back_cpu = round_trip("cpu")
    bad, out = [], {}
    for name in SHAPES:
        short = name.split(".")[-2]
        if name in QUANTIZED:
            scale = q.get(name + "_scale_inv")
            if q[name].dtype != torch.float8_e4m3fn or scale is None or scale.dtype != torch.float32:
                bad.append(f"{short}: {q[name].dtype} with scale {None if scale is None else scale.dtype}")
                continue
            if q[name].device.type != device or scale.device.type != device:
                bad.append(f"{short}: quantized on {q[name].device} / {scale.device}, not {device}")
            out[f"{short}_round"] = rel(back[name], src[name])
            out[f"{short}_device"] = max(rel(q[name], q_cpu[name]), rel(scale, q_cpu[name + "_scale_inv"]),
                                         rel(back[name], back_cpu[name]))
            if not out[f"{short}_round"] <= ROUND_TOL:
                bad.append(f"{short}: dequantized {out[f'{short}_round']:.3g} from bf16 > {ROUND_TOL}")
            if not out[f"{short}_device"] <= DEVICE_TOL:
                bad.append(f"{short}: {device} differs from cpu by {out[f'{short}_device']:.3g} > {DEVICE_TOL}")
        elif name + "_scale_inv" in q or q[name].dtype != torch.bfloat16 or not torch.equal(back[name].cpu(), src[name]):
            bad.append(f"{short}: should pass unquantized, got {q[name].dtype}")
    return out, bad


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    argparse.ArgumentParser(description="FP8 rollout weights quantized and dequantized on this machine's "
                                        "device (module doc).").parse_args(argv)
    out, bad = fp8_weights_check("cuda" if torch.cuda.is_available() else "cpu")
    print(("FAIL " + "; ".join(bad) + " | " if bad else "PASS ") + str(out))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
