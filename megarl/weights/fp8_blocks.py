"""Block-FP8 weights in DeepSeek-V3's checkpoint format: read them dequantized, write them quantized.

DeepSeek-V3 and Kimi-K2 ship their linear weights as float8_e4m3fn tensors `<name>` with a float32
`<name>_scale_inv` of one value per block of 128 x 128 elements (config.json `quantization_config`:
quant_method "fp8", weight_block_size [128, 128]); the real weight is

    W[i, j] = Q[i, j] * S[i // 128, j // 128]        (blocks at the edges are partial)

`dequantized(ckpt)` wraps an `HFCheckpoint` so the Megatron import (`megarl.weights.load_hf`) sees
plain float32 tensors under the weight names, read slice by slice like any other (a TP rank reads
its rows or columns of Q and the scale blocks that cover them); the `_scale_inv` tensors are not
separate names. `quantize(w)` is the inverse direction, for an SGLang engine started from such a
checkpoint (megarl.rollout.sglang): per block S = max|W| / 448 (448: the largest e4m3 value),
Q = W / S rounded to e4m3, as DeepSeek's own conversion does.

FP8 rollout weights (rollout.weights_dtype=fp8): the weight stream's buckets leave the trainer with
the linear weights quantized so (`quantized_stream`, `quantizable`: what an FP8 checkpoint of
Qwen3 / DeepSeek-V3 / GLM-4.5 stores in FP8); an engine that computes in floating point takes them
back with `dequantized_stream`, SGLang serves them as they are (`FP8_QUANTIZATION_CONFIG` in the
config.json it starts from).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0


def block_size(config: dict | None) -> tuple[int, int]:
    q = (config or {}).get("quantization_config") or {}
    rows, cols = q.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 W of the slice q = Q[rows, cols] (whole tensor by default), `scale` holding the
    scale blocks that cover it, starting at block (rows[0] // br, cols[0] // bc)."""
    br, bc = block
    r0 = (rows[0] if rows else 0) % br
    c0 = (cols[0] if cols else 0) % bc
    full = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return q.float() * full[r0:r0 + q.shape[0], c0:c0 + q.shape[1]]


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn, S float32 [ceil(n / br), ceil(k / bc)]) of a 2-D weight (module doc)."""
    br, bc = block
    n, k = w.shape
    nb, kb = math.ceil(n / br), math.ceil(k / bc)
    padded = torch.zeros(nb * br, kb * bc, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, br, kb, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(nb * br, kb * bc)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


Bucket = list[tuple[str, torch.Tensor]]
# what an engine's config.json says to serve block-FP8 weights (SGLang's Fp8Config reads it)
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
           "kv_b_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")


def quantizable(name: str, t: torch.Tensor) -> bool:
    """A 2-D linear weight of a decoder layer's attention or MLP (routed and shared experts
    included): what FP8 checkpoints store in FP8. Not the router's gate, embeddings, lm_head,
    norms, biases or the vision tower, which stay in the stream's dtype."""
    if t.dim() != 2 or not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or not name.endswith(".weight"):
        return False
    if ".layers." not in name or "visual" in name or "vision" in name:
        return False
    return name.rsplit(".", 2)[-2] in _LINEAR


def quantized_stream(buckets, select=quantizable, block: tuple[int, int] = (128, 128)):
    """Each bucket with the tensors `select(name, tensor)` picks replaced by their block-FP8 values
    and `_scale_inv` scales, in the same bucket."""
    for bucket in buckets:
        out: Bucket = []
        for name, t in bucket:
            if select(name, t):
                q, scale = quantize(t, block)
                out += [(name, q), (name + SCALE_SUFFIX, scale)]
            else:
                out.append((name, t))
        yield out


def dequantized_stream(buckets, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32):
    """The inverse of `quantized_stream`: every FP8 `<name>` of a bucket with its `<name>_scale_inv`
    (the same bucket) becomes W = Q * S in `dtype`; other tensors pass."""
    for bucket in buckets:
        scales = {n[: -len(SCALE_SUFFIX)]: t for n, t in bucket if n.endswith(SCALE_SUFFIX)}
        out: Bucket = []
        for name, t in bucket:
            if name.endswith(SCALE_SUFFIX):
                continue
            if t.dtype == torch.float8_e4m3fn:
                if name not in scales:
                    raise ValueError(f"FP8 weight {name!r} arrived without its {name + SCALE_SUFFIX} in the same bucket")
                t = dequantize(t, scales[name], block).to(dtype)
            out.append((name, t))
        yield out


class DequantizedCheckpoint:
    """An `HFCheckpoint` whose block-FP8 weights read as float32 (module doc); everything else is
    the wrapped checkpoint's."""

    def __init__(self, ckpt: Any, block: tuple[int, int]):
        self._ckpt, self.block = ckpt, block
        self.quantized = {n[: -len(SCALE_SUFFIX)] for n in ckpt.names() if n.endswith(SCALE_SUFFIX)}

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def names(self) -> set[str]:
        return {n for n in self._ckpt.names() if not n.endswith(SCALE_SUFFIX)}

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if name not in self.quantized:
            return self._ckpt.read(name, dim, start, stop)
        q = self._ckpt.read(name, dim, start, stop)
        if dim is None:
            return dequantize(q, self._ckpt.read(name + SCALE_SUFFIX), self.block)
        b = self.block[dim]
        scale = self._ckpt.read(name + SCALE_SUFFIX, dim, start // b, -(-stop // b))
        span = (start, stop)
        return dequantize(q, scale, self.block, rows=span if dim == 0 else None, cols=span if dim == 1 else None)


def dequantized(ckpt: Any, config: dict | None = None):
    """`ckpt` itself, or a `DequantizedCheckpoint` when it holds block-FP8 weights."""
    if not any(n.endswith(SCALE_SUFFIX) for n in ckpt.names()):
        return ckpt
    return DequantizedCheckpoint(ckpt, block_size(config))
