"""The builtin engine's Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) layers, as
transformers 5.19 computes them (`models/qwen3_next`, `models/qwen3_5`, `models/qwen3_5_moe`).

They plug into `torch_model.DecoderLM` (and `torch_qwen3_vl.Qwen3VisionLM` for Qwen3.5's images)
through `ModelArgs.variant` (a `HybridVariant`): each layer's token mixer under HF's name
(`linear_attn` or `self_attn`), zero-centred RMSNorms, partial RoPE and a cache of two kinds.

- Gated delta-net layers (`DeltaNet`) keep, per sequence, the convolution's last K-1 inputs
  [conv_dim, K-1] and the recurrent state [n_v, d_k, d_v] (float32, as HF and flash-linear-attention
  keep it): the same size at every length, no KV growth. Prefill runs the chunked rule over each
  left-padded row with its pad inputs zeroed (a zero input leaves both states at zero, so the first
  real token starts from HF's empty state) and keeps the final states; each decode step runs one
  convolution step and one recurrent step (`megarl.models.gdn_kernels`). In the cache these two
  states take the places of a layer's key and value buffers (`HybridCache`), so row selection and
  repetition (dim 0) treat them like any other layer's.
- Full-attention layers (`GatedAttention`): q_proj yields queries and per-head gates ([q_h; gate_h]
  per head), zero-centred q/k norms, RoPE on the first `partial_rotary_factor` of each head, output
  attention * sigmoid(gate) before o_proj; the usual K / V cache.
- MoE (Qwen3-Next, Qwen3.5-MoE): `torch_moe.SparseMoE` with the gated shared expert (per-expert HF
  names), top-k renormalised (Qwen3.5-MoE's router always renormalises); routing recorded for replay.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models import gdn_kernels as K
from megarl.models.gdn import GDNSpec
from megarl.models.rope import default_inv_freq, hf_rope_parameters
from megarl.rollout.torch_model import MLP, MODEL_FAMILIES, Attention, KVCache, ModelArgs, _get, _rotate_half
from megarl.rollout.torch_moe import SparseMoE


class ZeroCenteredRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + w), in float32, cast back (HF `Qwen3NextRMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


@dataclass(frozen=True)
class HybridVariant:
    """What the hybrid families add to `ModelArgs` (the `variant` protocol of torch_model)."""

    gdn: GDNSpec
    rotary_dim: int
    mtp_layers: int = 0  # not run by the engine (their tensors are `mtp.*`)
    norm = ZeroCenteredRMSNorm

    def mixer_name(self, index: int) -> str:
        return "linear_attn" if index in self.gdn.linear_layers else "self_attn"

    def layer(self, args: ModelArgs, index: int) -> tuple[nn.Module, nn.Module]:
        mixer = DeltaNet(args, self.gdn) if index in self.gdn.linear_layers else GatedAttention(args, self.rotary_dim)
        if not args.num_experts:
            return mixer, MLP(args)
        return mixer, SparseMoE(args.hidden_size, args.num_experts, args.moe_topk, args.moe_intermediate_size,
                                args.norm_topk_prob, args.shared_expert_intermediate_size)

    def rope(self, args: ModelArgs) -> tuple[torch.Tensor, float]:
        return default_inv_freq(args.rope_theta, self.rotary_dim), 1.0

    def state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        g = self.gdn
        return (batch, g.conv_dim, g.conv_kernel - 1), (batch, g.num_value_heads, g.key_head_dim, g.value_head_dim)

    def cache_shapes(self, args: ModelArgs, batch: int, max_len: int):
        shape = (batch, args.num_kv_heads, max_len, args.head_dim)  # the full-attention layers'
        return shape, shape

    def cache_bytes(self, args: ModelArgs, batch: int, max_len: int, element: int) -> int:
        """attention layers x 2 x batch x max_len x kv_heads x head_dim x element size, plus per delta-net
        layer batch x (conv_dim x (K-1) x element size + n_v x d_k x d_v x 4): constant in max_len."""
        linear = len(self.gdn.linear_layers)
        conv, state = self.state_shapes(batch)
        kv = 2 * math.prod(self.cache_shapes(args, batch, max_len)[0]) * element
        return (args.num_layers - linear) * kv + linear * (math.prod(conv) * element + math.prod(state) * 4)

    def cache_detail(self, args: ModelArgs, batch: int, max_len: int) -> str:
        return (f"{args.num_layers - len(self.gdn.linear_layers)} attention layers of 2 x {batch} sequences x "
                f"{max_len} tokens x {args.num_kv_heads} KV heads x {args.head_dim}, plus constant recurrent states")

    def allocate_cache(self, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype, device) -> "HybridCache":
        keys, values = [], []
        conv, state = self.state_shapes(batch)
        k, v = self.cache_shapes(args, batch, max_len)
        for i in range(args.num_layers):
            if i in self.gdn.linear_layers:
                keys.append(torch.zeros(conv, dtype=dtype, device=device))
                values.append(torch.zeros(state, dtype=torch.float32, device=device))
            else:
                keys.append(torch.empty(k, dtype=dtype, device=device))
                values.append(torch.empty(v, dtype=dtype, device=device))
        return HybridCache(keys, values, frozenset(self.gdn.linear_layers))


class HybridCache(KVCache):
    """`KVCache` whose delta-net layers hold (conv state, recurrent state) in place of (keys, values)."""

    def __init__(self, keys, values, linear: frozenset):
        super().__init__(keys, values)
        self.linear = linear

    def write_rows(self, rows: torch.Tensor, part: "HybridCache", width: int) -> None:
        for i, (fk, fv, pk, pv) in enumerate(zip(self.keys, self.values, part.keys, part.values)):
            if i in self.linear:  # states of the prefilled rows, whatever their width
                fk[rows], fv[rows] = pk, pv
                continue
            for full, new in ((fk, pk), (fv, pv)):
                full[rows, :, width - new.shape[2]:width] = new
                full[rows, :, :width - new.shape[2]] = 0


class GatedAttention(Attention):
    """Qwen3-Next / Qwen3.5 full attention (module doc)."""

    def __init__(self, args: ModelArgs, rotary_dim: int):
        super().__init__(args)
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, 2 * args.num_heads * d, bias=False)
        self.q_norm, self.k_norm = ZeroCenteredRMSNorm(d, args.rms_norm_eps), ZeroCenteredRMSNorm(d, args.rms_norm_eps)
        self.rotary_dim = rotary_dim

    def rotate(self, q, k, cos, sin):
        rd = self.rotary_dim
        return (torch.cat([q[..., :rd] * cos + _rotate_half(q[..., :rd]) * sin, q[..., rd:]], dim=-1),
                torch.cat([k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin, k[..., rd:]], dim=-1))

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        a = self.args
        bsz, t, _ = x.shape
        q, gate = self.q_proj(x).view(bsz, t, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(bsz, t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(bsz, t, a.num_kv_heads, a.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rotate(q, k, cos, sin)
        k_cache[:, :, start:start + t] = k
        v_cache[:, :, start:start + t] = v
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :start + t], v_cache[:, :, :start + t], attn_mask=mask,
            scale=a.head_dim ** -0.5, enable_gqa=a.num_heads != a.num_kv_heads)
        out = out.transpose(1, 2).reshape(bsz, t, -1) * torch.sigmoid(gate.reshape(bsz, t, -1))
        return self.o_proj(out)


class DeltaNet(nn.Module):
    """A gated delta-net layer with HF's parameter names (module doc); its cache entries are
    (conv state [B, conv_dim, K-1], recurrent state [B, n_v, d_k, d_v]), updated in place."""

    def __init__(self, args: ModelArgs, gdn: GDNSpec):
        super().__init__()
        h, self.g = args.hidden_size, gdn
        if gdn.hf_layout == "qwen3_next":
            r = gdn.num_value_heads // gdn.num_key_heads
            self.in_proj_qkvz = nn.Linear(h, gdn.num_key_heads * (2 * gdn.key_head_dim + 2 * r * gdn.value_head_dim), bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * gdn.num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, gdn.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, gdn.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, gdn.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(h, gdn.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(gdn.conv_dim, gdn.conv_dim, gdn.conv_kernel, bias=False, groups=gdn.conv_dim,
                                padding=gdn.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(gdn.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(gdn.num_value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(gdn.value_head_dim))
        self.out_proj = nn.Linear(gdn.value_dim, h, bias=False)
        self.eps = args.rms_norm_eps

    def project(self, x: torch.Tensor):
        """(q|k|v inputs of the conv [B, T, conv_dim], z [B, T, n_v, d_v], b, a [B, T, n_v])."""
        g, (bsz, t, _) = self.g, x.shape
        if g.hf_layout != "qwen3_next":
            z = self.in_proj_z(x).view(bsz, t, -1, g.value_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = g.num_value_heads // g.num_key_heads
        sizes = [g.key_head_dim, g.key_head_dim, r * g.value_head_dim, r * g.value_head_dim]
        q, k, v, z = self.in_proj_qkvz(x).view(bsz, t, g.num_key_heads, -1).split(sizes, dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, t, g.num_key_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], dim=-1)
        return mixed, z.reshape(bsz, t, -1, g.value_head_dim), b.reshape(bsz, t, -1), a.reshape(bsz, t, -1)

    def forward(self, x, cos, sin, conv_state, state, start, mask):
        g, (bsz, t, _) = self.g, x.shape
        valid = mask[:, 0, -1, start:start + t]  # a row's last query is a real token: its keys are the row's real tokens
        x = x * valid[..., None].to(x.dtype)  # pads leave both states at zero
        mixed, z, b, a = self.project(x)
        weight = self.conv1d.weight[:, 0]
        if t == 1 and start > 0:
            qkv, conv_new = K.conv_step(mixed[:, 0], conv_state, weight)
            qkv = qkv[:, None]
        elif start == 0:
            cu = [i * t for i in range(bsz + 1)]
            qkv = K.causal_conv1d_packed(mixed.reshape(bsz * t, -1), weight, cu).view(bsz, t, -1)
            conv_new = K.last_inputs(mixed, g.conv_kernel)
        else:
            raise ValueError("the delta-net continues a cached row one token at a time")
        ratio = g.num_value_heads // g.num_key_heads
        q, k, v = qkv.split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        q = q.reshape(bsz, t, -1, g.key_head_dim).repeat_interleave(ratio, dim=2)
        k = k.reshape(bsz, t, -1, g.key_head_dim).repeat_interleave(ratio, dim=2)
        v = v.reshape(bsz, t, -1, g.value_head_dim)
        gate, beta = K.gdn_gates(a, b, self.A_log, self.dt_bias)
        if t == 1 and start > 0:
            o, new_state = K.recurrent_step(q[:, 0], k[:, 0], v[:, 0], gate[:, 0], beta[:, 0], state)
            o = o[:, None]
        else:
            flat = [y.reshape(bsz * t, *y.shape[2:]) for y in (q, k, v, gate, beta)]
            o, new_state = K.chunk_gated_delta_rule(*flat, [i * t for i in range(bsz + 1)], output_final_state=True)
            o = o.view(bsz, t, *o.shape[1:])
        conv_state.copy_(conv_new)
        state.copy_(new_state)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm.weight * of.to(o.dtype) * F.silu(z.float())).to(o.dtype)
        return self.out_proj(o.reshape(bsz, t, -1))


# ---- config.json -> ModelArgs ---------------------------------------------------------------------

def _gdn(text: dict, model_type: str, hf_layout: str) -> GDNSpec:
    from megarl.models.hybrid import gdn_spec

    try:
        return gdn_spec(SimpleNamespace(**{"hidden_act": "silu", **text}), model_type, hf_layout)
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"config.json: {model_type} {e}") from e


def _hybrid_args(text: dict, model_type: str, hf_layout: str, moe: bool, always_renormalise: bool) -> ModelArgs:
    from megarl.rollout.torch_model import _common_args

    gdn = _gdn(text, model_type, hf_layout)
    params = hf_rope_parameters(text)
    if params["rope_type"] != "default":
        raise ValueError(f"config.json: {model_type} rope type {params['rope_type']!r} is not supported by the "
                         "builtin engine")
    head_dim = int(_get(text, "head_dim", text["hidden_size"] // text["num_attention_heads"]))
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    common = _common_args({k: v for k, v in text.items() if k != "layer_types"}
                          | {"intermediate_size": _get(text, "intermediate_size", 0), "head_dim": head_dim})
    args = ModelArgs(**common, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
                     variant=HybridVariant(gdn, rotary_dim, int(_get(text, "mtp_num_hidden_layers", 0))))
    if not moe:
        return args
    if _get(text, "decoder_sparse_step", 1) != 1 or text.get("mlp_only_layers"):
        raise ValueError(f"config.json: {model_type} with dense layers (decoder_sparse_step / mlp_only_layers) is "
                         "not supported by the builtin engine")
    return dataclasses.replace(
        args, num_experts=int(text["num_experts"]), moe_topk=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=always_renormalise or bool(_get(text, "norm_topk_prob", True)),
        shared_expert_intermediate_size=int(_get(text, "shared_expert_intermediate_size", 0)))


@MODEL_FAMILIES.register("qwen3_next")
def _qwen3_next_args(cfg: dict) -> ModelArgs:
    return _hybrid_args(cfg, "qwen3_next", "qwen3_next", moe=True, always_renormalise=False)


def _qwen3_5_args(cfg: dict) -> ModelArgs:
    """Qwen3.5 / Qwen3.5-MoE: the hybrid LM of `text_config`, the Qwen3-VL tower (no DeepStack),
    interleaved M-RoPE over the rotated part of each head."""
    from megarl.rollout.torch_qwen3_vl import config_vision_spec

    model_type = cfg["model_type"]
    v, text = cfg.get("vision_config"), cfg.get("text_config")
    if not isinstance(v, dict) or not isinstance(text, dict):
        raise ValueError(f"config.json: model_type={model_type!r} needs a 'vision_config' and a 'text_config'")
    text = dict(text, tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", _get(text, "tie_word_embeddings", False))))
    args = _hybrid_args(text, model_type, "qwen3_5", moe=model_type == "qwen3_5_moe", always_renormalise=True)
    section = tuple(int(x) for x in (text.get("rope_parameters") or {}).get("mrope_section") or ())
    if len(section) != 3 or sum(section) != args.variant.rotary_dim // 2:
        raise ValueError(f"config.json: mrope_section={list(section)} must be 3 sections summing to the rotated "
                         f"head_dim/2 = {args.variant.rotary_dim // 2}")
    vision = config_vision_spec(cfg, model_type)
    if vision.out_hidden_size != args.hidden_size or vision.deepstack_visual_indexes:
        raise ValueError(f"config.json: {model_type} vision out_hidden_size={vision.out_hidden_size} must equal the "
                         f"text hidden_size={args.hidden_size}, without DeepStack")
    return dataclasses.replace(args, mrope_section=section, vision=vision)


MODEL_FAMILIES.register("qwen3_5")(_qwen3_5_args)
MODEL_FAMILIES.register("qwen3_5_moe")(_qwen3_5_args)
