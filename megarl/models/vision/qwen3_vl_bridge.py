"""HF <-> Megatron names and layouts of Qwen3-VL-MoE beyond the dense / MoE LM rules of
`megarl.models.bridge` (which maps the LM under the `model.language_model.` prefix).

Vision tower (`vision_model.*` in megatron, first pipeline stage; `model.visual.*` in HF): the
layouts of `megarl.models.vision.bridge` (`replicated`, `row`, `col`, `fused_qkv`); LayerNorms have
weight and bias; the block MLP is fc1 (`col`) -> activation -> fc2 (`row`); the merger and each
DeepStack merger are norm + `mlp.encoder.linear_fc1` (`col`) + `linear_fc2` (`row`, bias replicated).

Experts: HF checkpoints hold each layer's experts as two tensors, with expert g at index g of dim 0,
in the released layout below (the released Qwen3-VL-MoE checkpoints, and what megarl writes) or
transposed ([E, 2I, H] / [E, H, I]: transformers 5's `save_pretrained`), which
`megarl.weights.HFCheckpoint` presents in the released layout (`megarl.weights.expert_layout`):

| layout          | HF tensor                                 | megatron local expert (ETP rank r of etp)  |
| ---             | ---                                       | ---                                         |
| experts_gate_up | mlp.experts.gate_up_proj [E, H, 2I]:      | linear_fc1.weight [2I/etp, H] =             |
|                 | [g] = [gate_g; up_g]^T  ([2I, H]^T)       | [gate_g rows r*I/etp..; up_g rows r*I/etp..]|
| experts_down    | mlp.experts.down_proj [E, I, H]: [g] = down_g^T | linear_fc2.weight [H, I/etp]: columns r*I/etp.. |

(transformers >= 5 keeps them in memory transposed and converts on load.)
A `ParamMap` of one local expert names the whole tensor, with `hf_expert` = g; `merge_fused_experts`
turns the ETP shards of all local experts of a layer (stacked) into this EP rank's [E/ep, ...] part,
and the weight stream concatenates the EP ranks' parts in rank order (g = e * E/ep + i).
"""

from __future__ import annotations

import re

import torch

FUSED_EXPERT_LAYOUTS = ("experts_gate_up", "experts_down")
_HF = "model.visual."
_BLOCK_RE = re.compile(r"^vision_model\.blocks\.(\d+)\.(.+)$")
_MERGER_RE = re.compile(r"^vision_model\.(merger|deepstack_merger_list\.\d+)\.(.+)$")
_BLOCK_RULES: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": ("norm1.weight", "replicated"),
    "input_layernorm.bias": ("norm1.bias", "replicated"),
    "self_attention.linear_qkv.weight": ("attn.qkv.weight", "fused_qkv"),
    "self_attention.linear_qkv.bias": ("attn.qkv.bias", "fused_qkv"),
    "self_attention.linear_proj.weight": ("attn.proj.weight", "row"),
    "self_attention.linear_proj.bias": ("attn.proj.bias", "replicated"),
    "pre_mlp_layernorm.weight": ("norm2.weight", "replicated"),
    "pre_mlp_layernorm.bias": ("norm2.bias", "replicated"),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", "col"),
    "mlp.linear_fc1.bias": ("mlp.linear_fc1.bias", "col"),
    "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight", "row"),
    "mlp.linear_fc2.bias": ("mlp.linear_fc2.bias", "replicated"),
}
_MERGER_RULES: dict[str, tuple[str, str]] = {
    "norm.weight": ("norm.weight", "replicated"),
    "norm.bias": ("norm.bias", "replicated"),
    "mlp.encoder.linear_fc1.weight": ("linear_fc1.weight", "col"),
    "mlp.encoder.linear_fc1.bias": ("linear_fc1.bias", "col"),
    "mlp.encoder.linear_fc2.weight": ("linear_fc2.weight", "row"),
    "mlp.encoder.linear_fc2.bias": ("linear_fc2.bias", "replicated"),
}
_OTHER_RULES: dict[str, tuple[str, str]] = {
    "vision_model.patch_embed.proj.weight": ("patch_embed.proj.weight", "replicated"),
    "vision_model.patch_embed.proj.bias": ("patch_embed.proj.bias", "replicated"),
    "vision_model.pos_embed.weight": ("pos_embed.weight", "replicated"),
}


def map_qwen3_vision_param(name: str, param_map_cls):
    """The `ParamMap` of tower parameter `name` (`vision_model.*`); KeyError if unknown."""
    if name in _OTHER_RULES:
        hf, layout = _OTHER_RULES[name]
        return param_map_cls(name, (_HF + hf,), layout)
    for pattern, rules, hf_dir in ((_BLOCK_RE, _BLOCK_RULES, "blocks.{}."), (_MERGER_RE, _MERGER_RULES, "{}.")):
        m = pattern.match(name)
        if m and m.group(2) in rules:
            hf, layout = rules[m.group(2)]
            return param_map_cls(name, (_HF + hf_dir.format(m.group(1)) + hf,), layout)
    raise KeyError(f"no HF mapping for megatron vision parameter {name!r} (qwen3_vl_moe)")


def qwen3_vision_hf_shapes(v) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every HF `model.visual.*` tensor for a `Qwen3VisionSpec`."""
    c, f, u, out = v.hidden_size, v.ffn_hidden_size, v.merged_size, v.out_hidden_size
    shapes = {_HF + "patch_embed.proj.weight": (c, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
              _HF + "patch_embed.proj.bias": (c,), _HF + "pos_embed.weight": (v.num_position_embeddings, c)}
    block = {"norm1.weight": (c,), "norm1.bias": (c,), "norm2.weight": (c,), "norm2.bias": (c,),
             "attn.qkv.weight": (3 * c, c), "attn.qkv.bias": (3 * c,), "attn.proj.weight": (c, c),
             "attn.proj.bias": (c,), "mlp.linear_fc1.weight": (f, c), "mlp.linear_fc1.bias": (f,),
             "mlp.linear_fc2.weight": (c, f), "mlp.linear_fc2.bias": (c,)}
    for i in range(v.depth):
        shapes.update({f"{_HF}blocks.{i}.{k}": s for k, s in block.items()})
    mlp = {"linear_fc1.weight": (u, u), "linear_fc1.bias": (u,), "linear_fc2.weight": (out, u),
           "linear_fc2.bias": (out,)}
    mergers = [("merger", c)] + [(f"deepstack_merger_list.{j}", u) for j in range(len(v.deepstack_visual_indexes))]
    for prefix, norm in mergers:
        shapes.update({f"{_HF}{prefix}.norm.weight": (norm,), f"{_HF}{prefix}.norm.bias": (norm,)})
        shapes.update({f"{_HF}{prefix}.{k}": s for k, s in mlp.items()})
    return shapes


def fused_expert_names(prefix: str, layer: int) -> dict[str, tuple[str, str]]:
    """Megatron expert-weight suffix -> (HF fused tensor, layout) of one layer."""
    return {"linear_fc1.weight": (f"{prefix}layers.{layer}.mlp.experts.gate_up_proj", "experts_gate_up"),
            "linear_fc2.weight": (f"{prefix}layers.{layer}.mlp.experts.down_proj", "experts_down")}


def fused_expert_shapes(prefix: str, layer: int, experts: int, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """HF fused expert tensors of one layer: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    return {f"{prefix}layers.{layer}.mlp.experts.gate_up_proj": (experts, hidden, 2 * ffn),
            f"{prefix}layers.{layer}.mlp.experts.down_proj": (experts, ffn, hidden)}


def fused_expert_hf_shape(layout: str, local_shape: tuple[int, ...], experts: int, etp: int) -> tuple[int, ...]:
    """Full HF shape from one local expert's shard shape ([2I/etp, H] or [H, I/etp])."""
    if layout == "experts_gate_up":
        return (experts, local_shape[1], local_shape[0] * etp)
    return (experts, local_shape[1] * etp, local_shape[0])


def read_fused_expert(reader, name: str, layout: str, expert: int, etp_rank: int, etp: int) -> torch.Tensor:
    """This ETP rank's shard of expert `expert`, read from its row of the fused HF tensor."""
    full = reader.read(name, 0, expert, expert + 1)[0].t()  # [2I, H] = [gate; up], or [H, I]
    if layout == "experts_gate_up":
        gate, up = full.chunk(2)
        n = gate.shape[0]
        if n % etp:
            raise ValueError(f"{name}: moe_intermediate_size {n} is not divisible by expert-TP size {etp}")
        a, b = etp_rank * n // etp, (etp_rank + 1) * n // etp
        return torch.cat([gate[a:b], up[a:b]]).contiguous()
    n = full.shape[1]
    if n % etp:
        raise ValueError(f"{name}: moe_intermediate_size {n} is not divisible by expert-TP size {etp}")
    return full[:, etp_rank * n // etp: (etp_rank + 1) * n // etp].contiguous()


def merge_fused_experts(layout: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """This EP rank's part [E/ep, H, 2I] / [E/ep, I, H] of the HF tensor from the ETP shards (rank
    order) of its local experts stacked: [E/ep, 2I/etp, H] (gate rows then up rows) / [E/ep, H, I/etp]."""
    if layout == "experts_gate_up":
        halves = [s.chunk(2, dim=1) for s in shards]
        local = torch.cat([torch.cat([h[0] for h in halves], dim=1), torch.cat([h[1] for h in halves], dim=1)], dim=1)
    else:
        local = torch.cat(shards, dim=2)
    return local.transpose(1, 2).contiguous()
