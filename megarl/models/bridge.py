"""HF <-> Megatron weight bridge for the dense families (Qwen2/2.5, Qwen3, Llama).

Each megatron parameter maps to one or more HF tensors with a TP layout:

| layout     | megatron (per TP rank r of tp)                        | HF                          |
| ---        | ---                                                   | ---                         |
| replicated | full tensor (norms, value head)                       | same                        |
| vocab      | rows [r*Vp/tp, (r+1)*Vp/tp) of the padded vocab Vp    | rows [0, V) (padding cut)   |
| row        | columns [r*n/tp, (r+1)*n/tp)  (linear_proj, fc2)      | full                        |
| qkv        | query groups [r*G/tp, (r+1)*G/tp), each laid out as   | q_proj, k_proj, v_proj      |
|            | [q (H/G*d rows), k (d rows), v (d rows)]              |                             |
| fc1        | [gate rows r*F/tp.., ; up rows r*F/tp..]              | gate_proj, up_proj          |

MoE layers (`ArchSpec.num_experts > 0`): the router (`mlp.router.weight` <-> `mlp.gate.weight`)
and the shared-expert gate are replicated, the shared expert is an fc1/row MLP over TP, and each
local expert i of expert-parallel rank e (of ep) is HF expert g = e * (E/ep) + i, with its fc1/row
shards taken over the expert-tensor-parallel group (`ParamMap.expert`; `expert_hf_names` lists
the HF names of the same local slot on every EP rank, the order the weight stream gathers them).

Qwen3-VL-MoE (`ArchSpec.hf_prefix` = `model.language_model.`, `ArchSpec.hf_fused_experts`) keeps all
experts of a layer in two HF tensors: layouts `experts_gate_up` / `experts_down`
(`megarl.models.vision.qwen3_vl_bridge`), whose `ParamMap.hf_expert` is the expert's index g in them.

Families named otherwise (`ArchSpec.hf_rules`: DeepSeek-V3 / Kimi-K2's multi-latent attention and
both its and GLM-4.5's `shared_experts` / `gate.e_score_correction_bias`) register a `FamilyRules`
in `FAMILY_RULES` (megarl.models.deepseek): layer rules over these, and every HF tensor's shape. A
router's selection bias is megatron's persistent buffer `mlp.router.expert_bias`: `param_maps`
lists it after the parameters (`ParamMap.buffer`), so it is loaded, streamed (in float32) and
saved like a weight, and no optimizer sees it.

Norm names of both layer specs are accepted: local (`input_layernorm`, `pre_mlp_layernorm`) and
TE, which fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`.
Layer indices are global: megatron's own `TransformerLayer.layer_number - 1` (PP/VPP offset).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megarl.models.families import ArchSpec

LAYOUTS = ("replicated", "vocab", "row", "qkv", "fc1", "col", "fused_qkv",  # col, fused_qkv: vision towers
           "experts_gate_up", "experts_down")  # fused HF expert tensors (qwen3_vl_moe)

_LAYER_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), "replicated"),
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "fc1"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "row"),
}
_EXPERT_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "fc1"),
    "linear_fc2.weight": (("down_proj.weight",), "row"),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_BUFFERS = ("mlp.router.expert_bias",)  # persistent buffers that are HF tensors (param_maps)
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
VALUE_HEAD_HF_NAME = "score.weight"


@dataclass(frozen=True)
class ParamMap:
    """Where one megatron parameter lives in HF naming."""

    megatron_name: str
    hf_names: tuple[str, ...]
    layout: str
    export: bool = True  # False: a copy of another exported tensor (tied output layer on last PP stage)
    optional: bool = False  # may be absent from an HF checkpoint (value head of a fresh critic)
    expert: int | None = None  # local expert slot: sharded over expert-TP, one expert per EP rank
    hf_expert: int | None = None  # fused expert layouts: the expert's index g in the HF tensor
    buffer: bool = False  # a persistent buffer (router expert_bias): loaded, streamed (in its own
    # dtype, float32, whatever the stream's dtype) and saved, never trained


@dataclass(frozen=True)
class FamilyRules:
    """HF naming of a family whose tensors are not named as Qwen / Llama's (`ArchSpec.hf_rules`):
    layer rules that extend / replace `_LAYER_RULES` and every HF tensor's shape."""

    layer_rules: dict
    expected_shapes: Callable  # fn(spec, value_head) -> {hf name: shape}


FAMILY_RULES: dict[str, FamilyRules] = {}  # ArchSpec.hf_rules -> rules (megarl.models.deepseek, hybrid_bridge)


@dataclass(frozen=True)
class LayoutHandler:
    """A TP layout defined elsewhere (megarl.models.hybrid_bridge): read(pm, reader, spec, local_shape,
    tp_rank, tp) -> this rank's shard; shapes(pm, local_shape, spec, tp) -> the HF shapes;
    merge(pm, shards, spec) -> the full HF tensors."""

    read: Callable
    shapes: Callable
    merge: Callable


LAYOUT_HANDLERS: dict[str, LayoutHandler] = {}  # layout name -> handler


def _layer_rules(spec: ArchSpec) -> dict:
    return {**_LAYER_RULES, **FAMILY_RULES[spec.hf_rules].layer_rules} if spec.hf_rules else _LAYER_RULES


def _ep() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()


def expert_hf_names(pm: ParamMap, spec: ArchSpec, ep: int) -> tuple[str, ...]:
    """HF names of local expert slot `pm.expert` on EP ranks 0..ep-1 (rank-major)."""
    local = spec.num_experts // ep
    prefix = spec.hf_prefix
    layer = re.match(rf"^{re.escape(prefix)}layers\.(\d+)\.", pm.hf_names[0]).group(1)
    suffixes, _ = _EXPERT_RULES[pm.megatron_name.rsplit(".mlp.experts.local_experts.", 1)[1].split(".", 1)[1]]
    return tuple(f"{prefix}layers.{layer}.mlp.experts.{r * local + pm.expert}.{s}"
                 for r in range(ep) for s in suffixes)


def map_param(name: str, model, spec: ArchSpec) -> ParamMap:
    """The HF mapping of parameter `name` (as in `model.named_parameters()`) of a GPTModel chunk."""
    if spec.vision is not None and name.startswith("vision_model."):  # megarl.models.vision.bridge
        from megarl.models.vision.bridge import map_vision_param

        return map_vision_param(name, ParamMap, spec.vision)
    prefix = spec.hf_prefix
    if name == "embedding.word_embeddings.weight":
        return ParamMap(name, (f"{prefix}embed_tokens.weight",), "vocab")
    if name == "decoder.final_layernorm.weight":
        return ParamMap(name, (f"{prefix}norm.weight",), "replicated")
    if name == "output_layer.weight":
        from megarl.models.value_head import ValueHead

        if isinstance(model.output_layer, ValueHead):
            return ParamMap(name, (VALUE_HEAD_HF_NAME,), "replicated", optional=True)
        if model.share_embeddings_and_output_weights:
            return ParamMap(name, (f"{prefix}embed_tokens.weight",), "vocab", export=False)
        return ParamMap(name, ("lm_head.weight",), "vocab")
    m = _LAYER_RE.match(name)
    rules = _layer_rules(spec)
    if m and m.group(2) in rules:
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1
        suffixes, layout = rules[m.group(2)]
        if m.group(2).endswith(_BUFFERS):
            return ParamMap(name, tuple(f"{prefix}layers.{layer}.{s}" for s in suffixes), layout, buffer=True)
        if layout == "col" and not getattr(model.get_parameter(name), "tensor_model_parallel", False):
            layout = "replicated"  # a replicated linear (multi-latent attention's down projections)
        return ParamMap(name, tuple(f"{prefix}layers.{layer}.{s}" for s in suffixes), layout)
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e and e.group(2) in _EXPERT_RULES:
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1
        ep, ep_rank = _ep()
        slot = int(e.group(1))
        g = ep_rank * (spec.num_experts // ep) + slot
        if spec.hf_fused_experts:
            from megarl.models.vision.qwen3_vl_bridge import fused_expert_names

            hf, layout = fused_expert_names(prefix, layer)[e.group(2)]
            return ParamMap(name, (hf,), layout, expert=slot, hf_expert=g)
        suffixes, layout = _EXPERT_RULES[e.group(2)]
        return ParamMap(name, tuple(f"{prefix}layers.{layer}.mlp.experts.{g}.{s}" for s in suffixes), layout,
                        expert=slot)
    raise KeyError(f"no HF mapping for megatron parameter {name!r} (model_type={spec.model_type!r})")


def param_maps(model, spec: ArchSpec) -> list[tuple[ParamMap, torch.nn.Parameter]]:
    """(ParamMap, parameter) for every parameter of one unwrapped GPTModel chunk, then
    (ParamMap, buffer) for its persistent buffers that are HF tensors (routers' expert_bias)."""
    out = [(map_param(n, model, spec), p) for n, p in model.named_parameters()]
    return out + [(map_param(n, model, spec), b) for n, b in model.named_buffers() if n.endswith(_BUFFERS)]


def outer_hf_shapes(spec: ArchSpec, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """The HF tensors outside the layers: embedding, final norm, and the LM head (or a critic's value head)."""
    h, prefix = spec.hidden_size, spec.hf_prefix
    shapes = {f"{prefix}embed_tokens.weight": (spec.vocab_size, h), f"{prefix}norm.weight": (h,)}
    if value_head:
        shapes[VALUE_HEAD_HF_NAME] = (1, h)
    elif not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def moe_hf_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """One Qwen-style MoE layer's HF tensors (names within the layer): the router, each expert (unless
    the family stores them fused), the shared expert and its gate."""
    h, fe, fs = spec.hidden_size, spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
    out = {"mlp.gate.weight": (spec.num_experts, h)}
    for g in range(0 if spec.hf_fused_experts else spec.num_experts):
        out.update({f"mlp.experts.{g}.gate_proj.weight": (fe, h), f"mlp.experts.{g}.up_proj.weight": (fe, h),
                    f"mlp.experts.{g}.down_proj.weight": (h, fe)})
    if fs:
        out.update({"mlp.shared_expert.gate_proj.weight": (fs, h), "mlp.shared_expert.up_proj.weight": (fs, h),
                    "mlp.shared_expert.down_proj.weight": (h, fs), "mlp.shared_expert_gate.weight": (1, h)})
    return out


def expected_hf_shapes(spec: ArchSpec, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every HF tensor of the whole model (all stages)."""
    if spec.hf_rules:
        return FAMILY_RULES[spec.hf_rules].expected_shapes(spec, value_head)
    h, d, f, prefix = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.hf_prefix
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    shapes = outer_hf_shapes(spec, value_head)
    layer = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    if spec.add_qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    if spec.qk_layernorm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if spec.num_experts:
        for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del layer[k]
        layer.update(moe_hf_shapes(spec))
    for i in range(spec.num_layers):
        shapes.update({f"{prefix}layers.{i}.{k}": v for k, v in layer.items()})
        if spec.num_experts and spec.hf_fused_experts:
            from megarl.models.vision.qwen3_vl_bridge import fused_expert_shapes

            shapes.update(fused_expert_shapes(prefix, i, spec.num_experts, h, spec.moe_ffn_hidden_size))
    if spec.vision is not None:
        from megarl.models.vision.bridge import vision_hf_shapes

        shapes.update(vision_hf_shapes(spec.vision))
    return shapes


# ---------------------------------------------------------------- TP layouts


class SliceReader(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor: ...


def _even_range(n: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if n % tp:
        raise ValueError(f"{what}: size {n} is not divisible by tensor-parallel size {tp}")
    per = n // tp
    return rank * per, (rank + 1) * per


def read_shard(pm: ParamMap, reader: SliceReader, spec: ArchSpec, local_shape: tuple[int, ...],
               tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of `pm`, read from HF tensors (slices only, never the full tensor)."""
    names, layout = pm.hf_names, pm.layout
    if layout in LAYOUT_HANDLERS:
        return LAYOUT_HANDLERS[layout].read(pm, reader, spec, local_shape, tp_rank, tp)
    if layout == "replicated":
        return reader.read(names[0])
    if layout == "vocab":
        per = local_shape[0]
        start, stop = tp_rank * per, min((tp_rank + 1) * per, spec.vocab_size)
        rows = reader.read(names[0], 0, start, stop) if stop > start else None
        out = torch.zeros(local_shape, dtype=rows.dtype if rows is not None else torch.float32)
        if rows is not None:
            out[: rows.shape[0]] = rows
        return out
    if layout == "row":
        start, stop = _even_range(reader.shape(names[0])[1], tp, tp_rank, names[0])
        return reader.read(names[0], 1, start, stop)
    if layout == "qkv":
        g0, g1 = _even_range(spec.num_query_groups, tp, tp_rank, f"{names[0]} query groups")
        d, hpg = spec.head_dim, spec.num_attention_heads // spec.num_query_groups
        q = reader.read(names[0], 0, g0 * hpg * d, g1 * hpg * d)
        k = reader.read(names[1], 0, g0 * d, g1 * d)
        v = reader.read(names[2], 0, g0 * d, g1 * d)
        rest = q.shape[1:]
        ng = g1 - g0
        return torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest),
                          v.reshape(ng, d, *rest)], dim=1).reshape(-1, *rest)
    if layout == "fc1":
        start, stop = _even_range(reader.shape(names[0])[0], tp, tp_rank, names[0])
        return torch.cat([reader.read(names[0], 0, start, stop), reader.read(names[1], 0, start, stop)])
    if layout == "col":
        start, stop = _even_range(reader.shape(names[0])[0], tp, tp_rank, names[0])
        return reader.read(names[0], 0, start, stop)
    if layout == "fused_qkv":
        from megarl.models.vision.bridge import read_fused_qkv

        return read_fused_qkv(reader, names[0], spec.vision.head_dim, tp_rank, tp)
    if layout in ("experts_gate_up", "experts_down"):
        from megarl.models.vision.qwen3_vl_bridge import read_fused_expert

        return read_fused_expert(reader, names[0], layout, pm.hf_expert, tp_rank, tp)
    raise ValueError(f"unknown layout {layout!r}")


def hf_shapes(pm: ParamMap, local_shape: tuple[int, ...], spec: ArchSpec, tp: int) -> list[tuple[int, ...]]:
    """Full HF shapes of the tensors `pm` exports, from this rank's local shard shape."""
    rest = tuple(local_shape[1:])
    if pm.layout in LAYOUT_HANDLERS:
        return LAYOUT_HANDLERS[pm.layout].shapes(pm, local_shape, spec, tp)
    if pm.layout == "replicated":
        return [tuple(local_shape)]
    if pm.layout == "vocab":
        return [(spec.vocab_size, *rest)]
    if pm.layout == "row":
        return [(local_shape[0], local_shape[1] * tp)]
    if pm.layout == "qkv":
        d = spec.head_dim
        return [(spec.num_attention_heads * d, *rest), (spec.num_query_groups * d, *rest),
                (spec.num_query_groups * d, *rest)]
    if pm.layout == "fc1":
        return [(local_shape[0] // 2 * tp, *rest)] * 2
    if pm.layout in ("col", "fused_qkv"):
        return [(local_shape[0] * tp, *rest)]
    if pm.layout in ("experts_gate_up", "experts_down"):
        from megarl.models.vision.qwen3_vl_bridge import fused_expert_hf_shape

        return [fused_expert_hf_shape(pm.layout, tuple(local_shape), spec.num_experts, tp)]
    raise ValueError(f"unknown layout {pm.layout!r}")


def merge_shards(pm: ParamMap, shards: list[torch.Tensor], spec: ArchSpec) -> list[torch.Tensor]:
    """Full HF tensors (in `pm.hf_names` order) from the TP shards of all ranks, in rank order."""
    if pm.layout in LAYOUT_HANDLERS:
        return LAYOUT_HANDLERS[pm.layout].merge(pm, shards, spec)
    if pm.layout == "replicated":
        return [shards[0]]
    if pm.layout == "vocab":
        return [torch.cat(shards)[: spec.vocab_size]]
    if pm.layout == "row":
        return [torch.cat(shards, dim=1)]
    if pm.layout == "qkv":
        full = torch.cat(shards)
        rest = full.shape[1:]
        d, hpg = spec.head_dim, spec.num_attention_heads // spec.num_query_groups
        grouped = full.reshape(spec.num_query_groups, (hpg + 2) * d, *rest)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if pm.layout == "fc1":
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if pm.layout == "col":
        return [torch.cat(shards)]
    if pm.layout == "fused_qkv":
        from megarl.models.vision.bridge import merge_fused_qkv

        return [merge_fused_qkv(shards, spec.vision.head_dim)]
    if pm.layout in ("experts_gate_up", "experts_down"):  # shards: the local experts stacked (dim 0)
        from megarl.models.vision.qwen3_vl_bridge import merge_fused_experts

        return [merge_fused_experts(pm.layout, shards)]
    raise ValueError(f"unknown layout {pm.layout!r}")



def shard_group(pm: ParamMap) -> tuple[int, int]:
    """(size, rank) of the group `pm` is sharded over: expert-TP for experts, else TP."""
    from megatron.core import parallel_state as ps

    if pm.expert is not None:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
