"""HF <-> Megatron names and TP layouts of the hybrid families (`megarl.models.hybrid`: Qwen3-Next,
Qwen3.5, Qwen3.5-MoE), beyond the Qwen rules of `megarl.models.bridge`.

Gated delta-net layers (`self_attention.*` of `megarl.models.gdn.GatedDeltaNet` <-> HF
`linear_attn.*`), with n_k key heads of d_k, n_v value heads of d_v, r = n_v / n_k, and TP rank t
of tp holding key heads [t n_k/tp, (t+1) n_k/tp) and value heads [t n_v/tp, (t+1) n_v/tp):

| layout              | megatron (TP rank t)                        | HF                                         |
| ---                 | ---                                         | ---                                        |
| gdn_in_proj         | in_proj [q_t; k_t; v_t; z_t; b_t; a_t]      | in_proj_qkv [q (n_k d_k); k; v (n_v d_v)], |
|                     | (the rank's heads of each)                  | in_proj_z [n_v d_v], in_proj_b, in_proj_a [n_v]  (Qwen3.5) |
| gdn_in_proj_grouped | the same                                    | in_proj_qkvz: per key head [q_h; k_h; v (r d_v); z (r d_v)], |
|                     |                                             | in_proj_ba: per key head [b (r); a (r)]   (Qwen3-Next) |
| gdn_conv            | conv1d.weight [q_t; k_t; v_t] channels      | conv1d.weight [q; k; v] channels, [C, 1, K] |
| col                 | A_log, dt_bias: the rank's value heads      | [n_v]                                      |

`out_norm.weight` (HF `norm.weight`) is replicated, `out_proj` is `row`. Full-attention layers
with an output gate (`qkv_gated`): HF's q_proj holds per head [q_h (d); gate_h (d)]; megatron's
linear_qkv per query group [q of its heads; gates of its heads; k; v], so query groups
[t G/tp, (t+1) G/tp) on TP rank t. Experts are HF's per-expert tensors (what transformers 5.19
writes for all three families, and what SGLang's Qwen3-Next / Qwen3.5 loaders take).
"""

from __future__ import annotations

import torch

from megarl.models.bridge import (
    _LAYER_RULES, FAMILY_RULES, LAYOUT_HANDLERS, FamilyRules, LayoutHandler, _even_range,
    moe_hf_shapes, outer_hf_shapes)
from megarl.models.families import ArchSpec

_LA = "linear_attn."
_GDN_COMMON = {
    "self_attention.conv1d.weight": ((_LA + "conv1d.weight",), "gdn_conv"),
    "self_attention.dt_bias": ((_LA + "dt_bias",), "col"),
    "self_attention.A_log": ((_LA + "A_log",), "col"),
    "self_attention.out_norm.weight": ((_LA + "norm.weight",), "replicated"),
    "self_attention.out_proj.weight": ((_LA + "out_proj.weight",), "row"),
    "self_attention.linear_qkv.weight": (_LAYER_RULES["self_attention.linear_qkv.weight"][0], "qkv_gated"),
}
RULES = {
    "qwen3_5": {**_GDN_COMMON, "self_attention.in_proj.weight": (
        tuple(_LA + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), "gdn_in_proj")},
    "qwen3_next": {**_GDN_COMMON, "self_attention.in_proj.weight": (
        (_LA + "in_proj_qkvz.weight", _LA + "in_proj_ba.weight"), "gdn_in_proj_grouped")},
}


# ---- gated attention: q_proj rows [q_h; gate_h] per head -----------------------------------------

def _read_qkv_gated(pm, reader, spec, local_shape, tp_rank, tp):
    g0, g1 = _even_range(spec.num_query_groups, tp, tp_rank, f"{pm.hf_names[0]} query groups")
    d, hpg, ng = spec.head_dim, spec.num_attention_heads // spec.num_query_groups, g1 - g0
    qg = reader.read(pm.hf_names[0], 0, g0 * hpg * 2 * d, g1 * hpg * 2 * d)
    rest = qg.shape[1:]
    qg = qg.reshape(ng, hpg, 2, d, *rest)
    k = reader.read(pm.hf_names[1], 0, g0 * d, g1 * d).reshape(ng, d, *rest)
    v = reader.read(pm.hf_names[2], 0, g0 * d, g1 * d).reshape(ng, d, *rest)
    parts = [qg[:, :, 0].reshape(ng, hpg * d, *rest), qg[:, :, 1].reshape(ng, hpg * d, *rest), k, v]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _merge_qkv_gated(pm, shards, spec):
    full = torch.cat(shards)
    rest = full.shape[1:]
    d, groups = spec.head_dim, spec.num_query_groups
    hpg = spec.num_attention_heads // groups
    q, gate, k, v = full.reshape(groups, (2 * hpg + 2) * d, *rest).split([hpg * d, hpg * d, d, d], dim=1)
    q_proj = torch.stack([q.reshape(groups, hpg, d, *rest), gate.reshape(groups, hpg, d, *rest)], dim=2)
    return [q_proj.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def _shapes_qkv_gated(pm, local_shape, spec, tp):
    rest, d = tuple(local_shape[1:]), spec.head_dim
    return [(2 * spec.num_attention_heads * d, *rest), (spec.num_query_groups * d, *rest),
            (spec.num_query_groups * d, *rest)]


# ---- gated delta-net: in_proj and conv channels ------------------------------------------------

def _split_rows(gdn, tp):
    """(q rows, v rows, value heads) of one TP rank."""
    return gdn.key_dim // tp, gdn.value_dim // tp, gdn.num_value_heads // tp


def _read_in_proj(pm, reader, spec, local_shape, tp_rank, tp):
    gdn = spec.gdn
    qr, vr, hr = _split_rows(gdn, tp)
    qkv, z, b, a = pm.hf_names
    t = tp_rank
    parts = [reader.read(qkv, 0, t * qr, (t + 1) * qr), reader.read(qkv, 0, gdn.key_dim + t * qr, gdn.key_dim + (t + 1) * qr),
             reader.read(qkv, 0, 2 * gdn.key_dim + t * vr, 2 * gdn.key_dim + (t + 1) * vr),
             reader.read(z, 0, t * vr, (t + 1) * vr), reader.read(b, 0, t * hr, (t + 1) * hr),
             reader.read(a, 0, t * hr, (t + 1) * hr)]
    return torch.cat(parts)


def _merge_in_proj(pm, shards, spec):
    sections = spec.gdn.in_proj_sections(len(shards))
    q, k, v, z, b, a = (torch.cat(parts) for parts in zip(*(s.split(sections) for s in shards)))
    return [torch.cat([q, k, v]), z, b, a]


def _shapes_in_proj(pm, local_shape, spec, tp):
    gdn, rest = spec.gdn, tuple(local_shape[1:])
    return [(gdn.conv_dim, *rest), (gdn.value_dim, *rest), (gdn.num_value_heads, *rest), (gdn.num_value_heads, *rest)]


def _grouped_sizes(gdn):
    r = gdn.num_value_heads // gdn.num_key_heads
    return r, [gdn.key_head_dim, gdn.key_head_dim, r * gdn.value_head_dim, r * gdn.value_head_dim]


def _read_in_proj_grouped(pm, reader, spec, local_shape, tp_rank, tp):
    gdn = spec.gdn
    r, sizes = _grouped_sizes(gdn)
    h0, h1 = _even_range(gdn.num_key_heads, tp, tp_rank, f"{pm.hf_names[0]} key heads")
    per = sum(sizes)
    blk = reader.read(pm.hf_names[0], 0, h0 * per, h1 * per)
    rest = blk.shape[1:]
    q, k, v, z = blk.reshape(h1 - h0, per, *rest).split(sizes, dim=1)
    b, a = reader.read(pm.hf_names[1], 0, h0 * 2 * r, h1 * 2 * r).reshape(h1 - h0, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v, z, b, a)])


def _merge_in_proj_grouped(pm, shards, spec):
    gdn = spec.gdn
    r, sizes = _grouped_sizes(gdn)
    local_heads = gdn.num_key_heads // len(shards)
    rest = shards[0].shape[1:]
    per_rank = [s.split(spec.gdn.in_proj_sections(len(shards))) for s in shards]
    qkvz = [torch.cat([p[i].reshape(local_heads, n, *rest) for p in per_rank]) for i, n in enumerate(sizes)]
    ba = [torch.cat([p[i].reshape(local_heads, r, *rest) for p in per_rank]) for i in (4, 5)]
    return [torch.cat(qkvz, dim=1).reshape(-1, *rest), torch.cat(ba, dim=1).reshape(-1, *rest)]


def _shapes_in_proj_grouped(pm, local_shape, spec, tp):
    gdn, rest = spec.gdn, tuple(local_shape[1:])
    r, sizes = _grouped_sizes(gdn)
    return [(gdn.num_key_heads * sum(sizes), *rest), (gdn.num_key_heads * 2 * r, *rest)]


def _read_conv(pm, reader, spec, local_shape, tp_rank, tp):
    gdn, name, t = spec.gdn, pm.hf_names[0], tp_rank
    qr, vr, _ = _split_rows(gdn, tp)
    return torch.cat([reader.read(name, 0, t * qr, (t + 1) * qr),
                      reader.read(name, 0, gdn.key_dim + t * qr, gdn.key_dim + (t + 1) * qr),
                      reader.read(name, 0, 2 * gdn.key_dim + t * vr, 2 * gdn.key_dim + (t + 1) * vr)])


def _merge_conv(pm, shards, spec):
    qr, vr, _ = _split_rows(spec.gdn, len(shards))
    q, k, v = (torch.cat(parts) for parts in zip(*(s.split([qr, qr, vr]) for s in shards)))
    return [torch.cat([q, k, v])]


def _shapes_conv(pm, local_shape, spec, tp):
    return [(spec.gdn.conv_dim, *tuple(local_shape[1:]))]


LAYOUT_HANDLERS.update({
    "qkv_gated": LayoutHandler(_read_qkv_gated, _shapes_qkv_gated, _merge_qkv_gated),
    "gdn_in_proj": LayoutHandler(_read_in_proj, _shapes_in_proj, _merge_in_proj),
    "gdn_in_proj_grouped": LayoutHandler(_read_in_proj_grouped, _shapes_in_proj_grouped, _merge_in_proj_grouped),
    "gdn_conv": LayoutHandler(_read_conv, _shapes_conv, _merge_conv),
})


# ---- every HF tensor ----------------------------------------------------------------------------

def _gdn_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    gdn, h = spec.gdn, spec.hidden_size
    out = {_LA + "conv1d.weight": (gdn.conv_dim, 1, gdn.conv_kernel), _LA + "dt_bias": (gdn.num_value_heads,),
           _LA + "A_log": (gdn.num_value_heads,), _LA + "norm.weight": (gdn.value_head_dim,),
           _LA + "out_proj.weight": (h, gdn.value_dim)}
    if gdn.hf_layout == "qwen3_next":
        r, sizes = _grouped_sizes(gdn)
        out.update({_LA + "in_proj_qkvz.weight": (gdn.num_key_heads * sum(sizes), h),
                    _LA + "in_proj_ba.weight": (gdn.num_key_heads * 2 * r, h)})
    else:
        out.update({_LA + "in_proj_qkv.weight": (gdn.conv_dim, h), _LA + "in_proj_z.weight": (gdn.value_dim, h),
                    _LA + "in_proj_b.weight": (gdn.num_value_heads, h), _LA + "in_proj_a.weight": (gdn.num_value_heads, h)})
    return out


def _attention_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    h, d, heads, groups = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_query_groups
    return {"self_attn.q_proj.weight": (2 * heads * d, h), "self_attn.k_proj.weight": (groups * d, h),
            "self_attn.v_proj.weight": (groups * d, h), "self_attn.o_proj.weight": (h, heads * d),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}


def _mlp_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    if not spec.num_experts:
        f = spec.ffn_hidden_size
        return {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return moe_hf_shapes(spec)


def expected_shapes(spec: ArchSpec, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of a hybrid model (multi-token-prediction layers excluded) with its shape."""
    h, prefix = spec.hidden_size, spec.hf_prefix
    shapes = outer_hf_shapes(spec, value_head)
    linear = set(spec.gdn.linear_layers)
    for i in range(spec.num_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), **_mlp_shapes(spec),
                 **(_gdn_shapes(spec) if i in linear else _attention_shapes(spec))}
        shapes.update({f"{prefix}layers.{i}.{k}": v for k, v in layer.items()})
    if spec.vision is not None:
        from megarl.models.vision.bridge import vision_hf_shapes

        shapes.update(vision_hf_shapes(spec.vision))
    return shapes


for _name, _rules in RULES.items():
    FAMILY_RULES[_name] = FamilyRules(_rules, expected_shapes)
