"""The builtin engine's DeepSeek-V3 / Kimi-K2 (`deepseek_v3`, `kimi_k2`) and GLM-4.5 (`glm4_moe`)
layers, as transformers 5.19 computes them (`models/deepseek_v3`, `models/glm4_moe`).

Both families plug into `torch_model.DecoderLM` through `ModelArgs.variant` (a `Variant`): each
layer's attention and MLP, the RoPE frequencies and the KV-cache layout.

Multi-latent attention (`LatentAttention`) caches the compressed latent, not the expanded K / V:
per layer and token the normalised c_kv (kv_lora_rank) and the rotated shared key k_rope
(qk_rope_head_dim), 576 values for DeepSeek-V3 against 128 heads x (192 + 128) = 40960 for the
expanded K and V. Attention then runs in the latent space ("weight absorption"): with
W_kvb = [W_uk; W_uv] per head,

    q_nope . k_nope = q_nope . (W_uk c) = (W_uk^T q_nope) . c,       o = W_uv (sum_j p_j c_j),

so each query is [W_uk^T q_nope, rope(q_rope)] against keys [c, rope(k_rope)] and values c, one
key/value head shared by all query heads, at HF's softmax scale. The same path serves prefill and
decode. It equals HF's expanded form up to float rounding (the products are associated
differently), which the tests bound at 1e-4 on log-probs.

GLM-4.5 (`PartialRopeAttention`) is standard GQA attention with RoPE (rotate-half layout) on the
first `partial_rotary_factor` of each head, q/k/v biases and optional per-head q/k norms; its
cache is the usual K / V.

The MoE (`SigmoidMoE`): sigmoid scores, the selection bias `gate.e_score_correction_bias` (kept in
float32 like HF's `_keep_in_fp32_modules_strict`, whatever the engine's dtype), group-limited
top-k (top-2 sum per group), renormalised weights times `routed_scaling_factor`, plus the ungated
`shared_experts`; the first `first_k_dense_replace` layers are dense. Routing is logged like
`torch_moe.SparseMoE`'s (routing replay); the dense layers' rows get filler experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.mla import MLASpec
from megarl.models.rope import default_inv_freq, hf_rope_parameters
from megarl.models.yarn import YarnSettings, attention_factor, softmax_mscale, yarn_inv_freq, yarn_settings
from megarl.rollout.torch_model import (
    MLP, MODEL_FAMILIES, Attention, ModelArgs, RMSNorm, _common_args, _get, _rotate_half)
from megarl.rollout.torch_moe import ExpertMLP, SparseMoE


@dataclass(frozen=True)
class Variant:
    """What DeepSeek-V3 / GLM-4.5 add to `ModelArgs` (the `variant` protocol of torch_model)."""

    mla: MLASpec | None  # None: GQA attention with partial RoPE (GLM)
    rotary_dim: int
    yarn: YarnSettings | None
    rope_interleave: bool
    first_dense: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    mtp_layers: int = 0  # num_nextn_predict_layers: checkpoint layers the engine skips

    def layer(self, args: ModelArgs, index: int) -> tuple[nn.Module, nn.Module]:
        attn = LatentAttention(args, self) if self.mla is not None else PartialRopeAttention(args, self)
        return attn, (MLP(args) if index < self.first_dense else SigmoidMoE(args, self))

    def rope(self, args: ModelArgs) -> tuple[torch.Tensor, float]:
        if self.yarn is not None:
            return yarn_inv_freq(args.rope_theta, self.rotary_dim, self.yarn), attention_factor(self.yarn)
        return default_inv_freq(args.rope_theta, self.rotary_dim), 1.0

    def cache_shapes(self, args: ModelArgs, batch: int, max_len: int):
        if self.mla is None:
            shape = (batch, args.num_kv_heads, max_len, args.head_dim)
            return shape, shape
        # the latent and the rotated shared key in the "key" buffer; no value buffer
        return (batch, 1, max_len, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim), (batch, 1, max_len, 0)

    def cache_detail(self, args: ModelArgs, batch: int, max_len: int) -> str:
        if self.mla is None:
            return f"2 x {batch} sequences x {max_len} tokens x {args.num_kv_heads} KV heads x {args.head_dim}"
        return (f"{batch} sequences x {max_len} tokens x (latent {self.mla.kv_lora_rank} + rotary key "
                f"{self.mla.qk_rope_head_dim})")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of x [B, heads, T, d] with cos / sin [B, 1, T, d] (cat(freqs, freqs) layout). interleave:
    pairs (x0, x1), (x2, x3), ... rotated and laid out as [evens, odds] (HF `rope_interleave`)."""
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek multi-latent attention over a cache of latents (module docstring). Attribute
    names are HF's (`self_attn.q_a_proj.weight`, `self_attn.kv_b_proj.weight`, ...)."""

    def __init__(self, args: ModelArgs, variant: Variant):
        super().__init__()
        m, h, heads = variant.mla, args.hidden_size, args.num_heads
        self.m, self.heads, self.interleave = m, heads, variant.rope_interleave
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * m.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, h, bias=False)
        self.scale = m.q_head_dim ** -0.5 * softmax_mscale(variant.yarn)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        m, heads = self.m, self.heads
        bsz, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(bsz, t, heads, m.q_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = _rope(q_rot, cos, sin, self.interleave)
        k_rot = _rope(k_rot[:, None], cos, sin, self.interleave)[:, 0]
        k_cache[:, 0, start:start + t] = torch.cat([latent, k_rot], dim=-1)
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]
        query = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_rot], dim=-1)
        keys = k_cache[:, :, :start + t]
        out = F.scaled_dot_product_attention(query, keys, keys[..., :m.kv_lora_rank], attn_mask=mask,
                                             scale=self.scale, enable_gqa=heads > 1)
        out = torch.einsum("bhtr,hvr->bthv", out, w_uv).reshape(bsz, t, heads * m.v_head_dim)
        return self.o_proj(out)


class PartialRopeAttention(Attention):
    """GLM-4.5 attention: `torch_model.Attention` (q/k/v bias, optional q/k norms, no o bias) with
    RoPE on the first `rotary_dim` of each head."""

    def __init__(self, args: ModelArgs, variant: Variant):
        super().__init__(args)
        self.rotary_dim = variant.rotary_dim

    def rotate(self, q, k, cos, sin):
        rd = self.rotary_dim
        return (torch.cat([_rope(q[..., :rd], cos, sin, False), q[..., rd:]], dim=-1),
                torch.cat([_rope(k[..., :rd], cos, sin, False), k[..., rd:]], dim=-1))


class SigmoidRouter(nn.Module):
    """`mlp.gate.weight` and the float32 selection bias `mlp.gate.e_score_correction_bias` (a
    parameter here so the weight stream loads it; the engine never trains)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias.dtype != torch.float32:  # a cast of the module leaves the bias in float32
            bias.data = bias.data.float()
        return self


class SigmoidMoE(SparseMoE):
    """DeepSeek-V3 / GLM-4.5 MoE block (module docstring)."""

    def __init__(self, args: ModelArgs, variant: Variant):
        nn.Module.__init__(self)
        self.topk, self.norm_topk_prob, self.variant = args.moe_topk, args.norm_topk_prob, variant
        self.gate = SigmoidRouter(args.hidden_size, args.num_experts)
        self.experts = nn.ModuleList(ExpertMLP(args.hidden_size, args.moe_intermediate_size)
                                     for _ in range(args.num_experts))
        if args.shared_expert_intermediate_size:
            self.shared_experts = ExpertMLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.routing_log: list[torch.Tensor] | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, experts) [tokens, k] as HF's DeepseekV3TopkRouter."""
        v, n = self.variant, self.gate.weight.shape[0]
        scores = F.linear(h.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        if v.n_group > 1:
            group_scores = choice.view(-1, v.n_group, n // v.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=v.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask[..., None].expand(-1, v.n_group, n // v.n_group).reshape(-1, n).bool()
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = torch.topk(choice, k=self.topk, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * v.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, experts = self.route(h)
        if self.routing_log is not None:
            self.routing_log.append(experts.sort(dim=-1).values)
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, (self.experts[e](h[rows]) * weights[rows, slot, None]).to(h.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(h)
        return out.view(shape)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def past_last_layer(name: str, args: ModelArgs) -> bool:
    """Whether `name` is a tensor of a multi-token-prediction layer (DeepSeek-V3 / GLM-4.5 store
    them as layers num_layers, ...; Qwen3-Next / Qwen3.5 under `mtp.`), which the engine does not run."""
    mtp = args.variant.mtp_layers if args.variant is not None else 0
    if mtp and name.startswith("mtp."):  # Qwen3-Next / Qwen3.5 keep them apart
        return True
    m = _LAYER_INDEX.match(name) if mtp else None
    return m is not None and args.num_layers <= int(m.group(1)) < args.num_layers + mtp


def _variant_args(cfg: dict, mla: MLASpec | None, rotary_dim: int, **fields) -> ModelArgs:
    params = hf_rope_parameters(cfg)
    yarn = yarn_settings(params, int(cfg["max_position_embeddings"])) if params["rope_type"] == "yarn" else None
    if params["rope_type"] not in ("default", "yarn") or (yarn is not None and mla is None):
        raise ValueError(f"config.json: rope type {params['rope_type']!r} is not supported for "
                         f"{cfg['model_type']} by the builtin engine")
    experts = int(cfg["n_routed_experts"])
    variant = Variant(mla=mla, rotary_dim=rotary_dim, yarn=yarn, rope_interleave=bool(_get(cfg, "rope_interleave", True)),
                      first_dense=int(_get(cfg, "first_k_dense_replace", 0)), n_group=int(_get(cfg, "n_group", 1)),
                      topk_group=int(_get(cfg, "topk_group", 1)),
                      routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
                      mtp_layers=int(_get(cfg, "num_nextn_predict_layers", _get(cfg, "num_mtp_layers", 0))))
    moe = int(cfg["moe_intermediate_size"])
    return ModelArgs(**{**_common_args(cfg), **fields}, mlp_bias=False, num_experts=experts,
                     moe_topk=int(cfg["num_experts_per_tok"]), moe_intermediate_size=moe,
                     norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
                     shared_expert_intermediate_size=moe * int(_get(cfg, "n_shared_experts", 0)), variant=variant)


@MODEL_FAMILIES.register("deepseek_v3", "kimi_k2")
def _deepseek_args(cfg: dict) -> ModelArgs:
    mla = MLASpec(q_lora_rank=int(_get(cfg, "q_lora_rank", 0)), kv_lora_rank=int(cfg["kv_lora_rank"]),
                  qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                  v_head_dim=int(cfg["v_head_dim"]))
    if _get(cfg, "attention_bias", False):
        raise ValueError("config.json: deepseek_v3 with attention_bias=True is not supported by the builtin engine")
    heads = int(cfg["num_attention_heads"])
    return _variant_args(cfg, mla, mla.qk_rope_head_dim, num_kv_heads=heads, head_dim=mla.q_head_dim,
                         qkv_bias=False, o_bias=False, qk_norm=False)


@MODEL_FAMILIES.register("glm4_moe")
def _glm4_moe_args(cfg: dict) -> ModelArgs:
    common = _common_args(cfg)
    rotary = float(hf_rope_parameters(cfg).get("partial_rotary_factor") or 1.0)
    return _variant_args(cfg, None, int(common["head_dim"] * rotary), qkv_bias=bool(_get(cfg, "attention_bias", False)),
                         o_bias=False, qk_norm=bool(_get(cfg, "use_qk_norm", False)))
