"""HF <-> Megatron names and TP layouts of the Qwen2.5-VL vision tower (`visual.*` in HF).

The language model maps like Qwen2 (`megarl.models.bridge`). Tower parameters live under
`vision_model.` in the megatron model (first pipeline stage only); layouts, besides the dense
ones (`replicated`, `row`, `fc1`):

| layout    | megatron (TP rank r of tp)                           | HF                              |
| ---       | ---                                                  | ---                             |
| col       | rows [r*n/tp, (r+1)*n/tp) (merger fc1 weight, bias)   | full                            |
| fused_qkv | heads [r*H/tp, (r+1)*H/tp), each as [q_h; k_h; v_h]    | attn.qkv: rows [q (H*d); k; v]   |
|           | (d = vision head_dim rows each)                      |                                 |

Row-parallel biases (attn.proj, down_proj, merger fc2) are added after the all-reduce, so they
are replicated; the SwiGLU gate/up weights and biases are `fc1` ([gate shard; up shard]).
"""

from __future__ import annotations

import re

import torch

VISION_PREFIX = "vision_model."
_BLOCK_RE = re.compile(r"^vision_model\.blocks\.(\d+)\.(.+)$")
_BLOCK_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("norm1.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (("attn.qkv.weight",), "fused_qkv"),
    "self_attention.linear_qkv.bias": (("attn.qkv.bias",), "fused_qkv"),
    "self_attention.linear_proj.weight": (("attn.proj.weight",), "row"),
    "self_attention.linear_proj.bias": (("attn.proj.bias",), "replicated"),
    "pre_mlp_layernorm.weight": (("norm2.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc1.bias": (("mlp.gate_proj.bias", "mlp.up_proj.bias"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.linear_fc2.bias": (("mlp.down_proj.bias",), "replicated"),
}
_OTHER_RULES: dict[str, tuple[str, str]] = {
    "vision_model.patch_embed.proj.weight": ("visual.patch_embed.proj.weight", "replicated"),
    "vision_model.merger.ln_q.weight": ("visual.merger.ln_q.weight", "replicated"),
    "vision_model.merger.mlp.encoder.linear_fc1.weight": ("visual.merger.mlp.0.weight", "col"),
    "vision_model.merger.mlp.encoder.linear_fc1.bias": ("visual.merger.mlp.0.bias", "col"),
    "vision_model.merger.mlp.encoder.linear_fc2.weight": ("visual.merger.mlp.2.weight", "row"),
    "vision_model.merger.mlp.encoder.linear_fc2.bias": ("visual.merger.mlp.2.bias", "replicated"),
}


def map_vision_param(name: str, param_map_cls, vision=None):
    """The `ParamMap` of tower parameter `name` (`vision_model.*`) of the tower `vision` describes
    (a Qwen3-VL tower: `qwen3_vl_bridge`); KeyError if unknown."""
    from megarl.models.vision.qwen3_vl_spec import Qwen3VisionSpec

    if isinstance(vision, Qwen3VisionSpec):
        from megarl.models.vision.qwen3_vl_bridge import map_qwen3_vision_param

        return map_qwen3_vision_param(name, param_map_cls)
    if name in _OTHER_RULES:
        hf, layout = _OTHER_RULES[name]
        return param_map_cls(name, (hf,), layout)
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_RULES:
        suffixes, layout = _BLOCK_RULES[m.group(2)]
        return param_map_cls(name, tuple(f"visual.blocks.{m.group(1)}.{s}" for s in suffixes), layout)
    raise KeyError(f"no HF mapping for megatron vision parameter {name!r}")


def vision_hf_shapes(v) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every HF `visual.*` tensor for a `VisionSpec` (`model.visual.*` for a
    `Qwen3VisionSpec`)."""
    from megarl.models.vision.qwen3_vl_spec import Qwen3VisionSpec

    if isinstance(v, Qwen3VisionSpec):
        from megarl.models.vision.qwen3_vl_bridge import qwen3_vision_hf_shapes

        return qwen3_vision_hf_shapes(v)
    c, f, u = v.hidden_size, v.ffn_hidden_size, v.merged_size
    shapes = {
        "visual.patch_embed.proj.weight": (c, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "visual.merger.ln_q.weight": (c,), "visual.merger.mlp.0.weight": (u, u), "visual.merger.mlp.0.bias": (u,),
        "visual.merger.mlp.2.weight": (v.out_hidden_size, u), "visual.merger.mlp.2.bias": (v.out_hidden_size,),
    }
    block = {"norm1.weight": (c,), "norm2.weight": (c,), "attn.qkv.weight": (3 * c, c), "attn.qkv.bias": (3 * c,),
             "attn.proj.weight": (c, c), "attn.proj.bias": (c,), "mlp.gate_proj.weight": (f, c),
             "mlp.gate_proj.bias": (f,), "mlp.up_proj.weight": (f, c), "mlp.up_proj.bias": (f,),
             "mlp.down_proj.weight": (c, f), "mlp.down_proj.bias": (c,)}
    for i in range(v.depth):
        shapes.update({f"visual.blocks.{i}.{k}": s for k, s in block.items()})
    return shapes


def read_fused_qkv(reader, name: str, head_dim: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's [q_h; k_h; v_h] rows for its heads, read as three row slices of HF's qkv."""
    rows = reader.shape(name)[0]
    heads = rows // (3 * head_dim)
    if heads % tp:
        raise ValueError(f"{name}: {heads} heads are not divisible by tensor-parallel size {tp}")
    h0, h1 = tp_rank * heads // tp, (tp_rank + 1) * heads // tp
    parts = [reader.read(name, 0, (j * heads + h0) * head_dim, (j * heads + h1) * head_dim) for j in range(3)]
    rest = parts[0].shape[1:]
    return torch.stack([p.reshape(h1 - h0, head_dim, *rest) for p in parts], dim=1).reshape(-1, *rest)


def merge_fused_qkv(shards: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """HF's qkv [q (H*d); k; v] from the per-head [q_h; k_h; v_h] shards of all TP ranks."""
    full = torch.cat(shards)
    rest = full.shape[1:]
    return full.reshape(-1, 3, head_dim, *rest).transpose(0, 1).reshape(-1, *rest)
