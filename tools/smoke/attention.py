"""Checks of megarl's local attention kernels against the blockwise reference, for tools/gpu_smoke.py
(checks `attn_kernels` and `attn_cp2`) and standalone:

    python -m tools.smoke.attention            # CUDA: varlen vs blockwise; CPU: sdpa vs blockwise

- `kernel_check`: one packed row of mixed lengths (GQA 14 / 2 heads, head dim 64), output and
  dq / dk / dv of the fast kernel (varlen on CUDA in bf16, sdpa on CPU in fp32) and of the
  blockwise path in the same dtype, each against a float32 blockwise reference; plus the time
  of one forward + backward of a row for both (CUDA: 16k tokens, 8 x 2k; CPU: 2k, 8 x 256).
- `cp_check` (CUDA): context parallelism 2 emulated on one GPU. Each of the two CP ranks' query
  chunk sets (chunks r and 3-r of every sequence) runs through the varlen kernel over the keys of
  its prefixes (`cp_prefix_segments`, bottom-right causal) and must equal those rows of the
  whole row's attention, gradients included.
- `mla_check`: multi-latent attention's widths (queries and keys 192, values 128, 16 heads, no
  GQA): the fast kernels zero-pad the values to one width and cut the output back; varlen (CUDA,
  bf16) and sdpa (fp32 on CPU, bf16 on CUDA) against the float32 blockwise reference.
Errors are relative: ||x - ref|| / ||ref||; bf16 rounding alone gives ~4e-3.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.smoke.attention`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/smoke/
    __import__("tools").run_as_module(__file__)

import math
import sys
import time


LENGTHS = (1000, 37, 512, 3, 2048, 130)  # each a multiple of 2*CP (CP=2) where cp_check needs it
HEADS, GROUPS, HEAD_DIM = 14, 2, 64


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _inputs(lengths, device, dtype, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    make = lambda h: torch.randn(cu[-1], h, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    return cu, make(HEADS), make(GROUPS), make(GROUPS)


def _run(fn, q, k, v, w):
    """(output, (dq, dk, dv)) of fn(q, k, v) for the loss sum(out * w)."""
    import torch

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    return out.detach(), grads


def _errors(name, got, ref) -> dict:
    (o, g), (ro, rg) = got, ref
    return {f"{name}_out": _rel(o, ro), **{f"{name}_d{x}": _rel(a, b) for x, a, b in zip("qkv", g, rg)}}


def _time(fn, q, k, v, repeat: int = 5) -> float:
    import torch

    w = torch.randn(q.shape, device=q.device)
    _run(fn, q, k, v, w)  # warm-up
    if q.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        _run(fn, q, k, v, w)
    if q.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def kernel_check(device: str) -> dict:
    """The fast kernel of this device (varlen on CUDA, bf16; sdpa on CPU, fp32) and blockwise in
    the same dtype, both against blockwise in float32."""
    import torch

    from megarl.models import attention_kernels as K
    from megarl.models.attention import sequence_coords
    from megarl.models.attention_blockwise import blockwise_attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cu, q, k, v = _inputs(LENGTHS, device, dtype)
    scale = HEAD_DIM ** -0.5
    seq, pos = sequence_coords(cu, device=device)
    block = lambda q, k, v: blockwise_attention(q, k, v, scale, seq, pos, seq, pos)
    if cuda:
        seg = K.self_segments(cu, device=device)
        fast_name, fast = "varlen", (lambda q, k, v: K.varlen_attention(q, k, v, scale, seg))
    else:
        groups, inverse = K.padded_groups(cu, device)
        fast_name, fast = "sdpa", (lambda q, k, v: K.sdpa_attention(q, k, v, scale, groups, inverse))
    w = torch.randn(q.shape, device=device)
    ref = _run(block, q.float(), k.float(), v.float(), w)
    out = {"dtype": str(dtype).replace("torch.", ""), "fast": fast_name}
    out.update(_errors(fast_name, _run(fast, q, k, v, w), ref))
    out.update(_errors("blockwise", _run(block, q, k, v, w), ref))
    cu16, q16, k16, v16 = _inputs((2048 if cuda else 256,) * 8, device, dtype, seed=1)
    seq16, pos16 = sequence_coords(cu16, device=device)
    if cuda:
        seg16 = K.self_segments(cu16, device=device)
        fast16 = lambda q, k, v: K.varlen_attention(q, k, v, scale, seg16)
    else:
        g16, i16 = K.padded_groups(cu16, device)
        fast16 = lambda q, k, v: K.sdpa_attention(q, k, v, scale, g16, i16)
    out["row_tokens"] = cu16[-1]
    out[f"{fast_name}_ms"] = 1e3 * _time(fast16, q16, k16, v16)
    out["blockwise_ms"] = 1e3 * _time(lambda q, k, v: blockwise_attention(q, k, v, scale, seq16, pos16, seq16, pos16),
                                          q16, k16, v16)
    return out


def cp_check(device: str = "cuda", cp: int = 2) -> dict:
    """Max relative error over the CP ranks of varlen's prefix segments against the float32 rows
    of the whole row's attention (CUDA, bf16)."""
    import torch

    from megarl.models import attention_kernels as K
    from megarl.models.attention import cp_shard_index, sequence_coords
    from megarl.models.attention_blockwise import blockwise_attention

    lengths = [2 * cp * math.ceil(n / (2 * cp)) for n in LENGTHS]
    cu, q, k, v = _inputs(lengths, device, torch.bfloat16, seed=2)
    scale = HEAD_DIM ** -0.5
    seq, pos = sequence_coords(cu, device=device)
    worst: dict = {}
    for r in range(cp):
        mine = cp_shard_index(cu, cp, r).to(device)
        seg = K.cp_prefix_segments(cu, cp, r, device)
        w = torch.randn(int(mine.numel()), HEADS, HEAD_DIM, device=device)
        ref = _run(lambda q, k, v: blockwise_attention(q[mine], k, v, scale, seq[mine], pos[mine], seq, pos),
                   q.float(), k.float(), v.float(), w)
        got = _run(lambda q, k, v: K.varlen_attention(q[mine], k, v, scale, seg), q, k, v, w)
        for key, val in _errors("varlen_cp", got, ref).items():
            worst[key] = max(worst.get(key, 0.0), val)
    return worst


def mla_check(device: str) -> dict:
    """The MLA widths through sdpa (and varlen on CUDA) against float32 blockwise."""
    import torch

    from megarl.models import attention_kernels as K
    from megarl.models.attention import sequence_coords
    from megarl.models.attention_blockwise import blockwise_attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(3)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    q, k = (torch.randn(cu[-1], 16, 192, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(cu[-1], 16, 128, generator=g).to(device=device, dtype=dtype)
    scale = 192 ** -0.5
    seq, pos = sequence_coords(cu, device=device)
    w = torch.randn(cu[-1], 16, 128, device=device)
    block = lambda q, k, v: blockwise_attention(q, k, v, scale, seq, pos, seq, pos)
    ref = _run(block, q.float(), k.float(), v.float(), w)
    groups, inverse = K.padded_groups(cu, device)
    sdpa = lambda q, k, v: K.sdpa_attention(q, k, v, scale, groups, inverse)
    out = {"dtype": str(dtype).replace("torch.", "")}
    out.update(_errors("mla_sdpa", _run(sdpa, q, k, v, w), ref))
    if cuda and K.varlen_function() is not None:
        seg = K.self_segments(cu, device=device)
        varlen = lambda q, k, v: K.varlen_attention(q, k, v, scale, seg)
        out.update(_errors("mla_varlen", _run(varlen, q, k, v, w), ref))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("kernel_check", kernel_check(device))
    print("mla_check", mla_check(device))
    if device == "cuda":
        print("cp_check", cp_check())
    return 0


if __name__ == "__main__":
    sys.exit(main())
