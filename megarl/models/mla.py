"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) on megatron-core: the facts, the config, the
layer spec and the HF naming of its weights.

HF's `DeepseekV3Attention` (transformers 5.19), per token x and head n:

    c_q  = RMSNorm(W_qa x)                     (q_lora_rank; without it q = W_q x directly)
    q_n  = W_qb c_q  -> [q_nope (qk_nope_head_dim), q_rope (qk_rope_head_dim)]
    [c_kv, k_rope] = W_kva x                   (kv_lora_rank + qk_rope_head_dim: the compressed latent)
    [k_nope_n, v_n] = W_kvb RMSNorm(c_kv)      (per head qk_nope_head_dim + v_head_dim)
    q = [q_nope, rope(q_rope)], k_n = [k_nope_n, rope(k_rope)]   (k_rope shared by every head)
    out = W_o concat_n softmax(q_n . k_n * scale) v_n

with scale = 1 / sqrt(qk_nope + qk_rope) (times YaRN's mscale^2, `megarl.models.yarn`) and RoPE
on interleaved pairs (`rope_interleave`, the default of every released checkpoint), which is what
megatron's `MLASelfAttention` computes (`multi_latent_attention=True` de-interleaves the same
way). megatron's projections: linear_q_proj | linear_q_down_proj + q_layernorm + linear_q_up_proj,
linear_kv_down_proj + kv_layernorm + linear_kv_up_proj, linear_proj. The down projections are
replicated over TP in both specs (`local_down_projection`; Transformer Engine's duplicated linear,
with the latent norms fused into the up projections); the up projections are column-parallel by
heads, linear_proj row-parallel. The bridge reads a "col" rule of a parameter without the
`tensor_model_parallel` flag as replicated. Core attention gets q, k of qk_nope + qk_rope and v of v_head_dim
per head (`megarl.models.attention.LocalAttention` handles the different value width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.models.norm import RMSNorm
from megarl.models.yarn import YarnSettings

LATENT_NORM_EPS = 1e-6  # HF's DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep


class LatentRMSNorm(RMSNorm):
    """The q / kv latent norms of the local spec: megarl's RMSNorm at HF's fixed epsilon (megatron
    would pass the model's rms_norm_eps)."""

    def __init__(self, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs):
        super().__init__(config, hidden_size, LATENT_NORM_EPS, **kwargs)


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int  # 0: q = W_q x (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn: YarnSettings | None = None  # None: plain RoPE over qk_rope_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_config_fields(m: MLASpec, rope_theta: float) -> dict[str, Any]:
    """megatron `MLATransformerConfig` fields for `m` (mscale_all_dim 0 keeps the softmax scale
    1 / sqrt(q_head_dim) when there is no YaRN)."""
    y = m.yarn
    return dict(
        multi_latent_attention=True, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        rope_type="yarn" if y else "rope", rotary_base=rope_theta,
        rotary_scaling_factor=y.factor if y else 1.0,
        original_max_position_embeddings=y.original_max_position_embeddings if y else 4096,
        beta_fast=y.beta_fast if y else 32.0, beta_slow=y.beta_slow if y else 1.0,
        mscale=y.mscale if y else 1.0, mscale_all_dim=y.mscale_all_dim if y else 0.0,
    )


def prepare_megatron_mla() -> None:
    """Two things megatron-core 0.16.1's `multi_latent_attention` gets wrong off a GPU with TE:
    it sets HAVE_TE when its import of megatron's TE extension succeeds, which it also does without
    Transformer Engine (the TE classes are then mock placeholders), and then fails on
    `isinstance(self.linear_proj, TELinear)`: without TE the flag is made False, which is what the
    module means by it. And it builds its rotary module without `use_cpu_initialization`, i.e. on
    `torch.cuda.current_device()`: without CUDA (megarl's CPU runtime) it builds it on the host,
    as GPTModel does for its own rotary module with `config.use_cpu_initialization`; the module
    moves its frequencies to the current device at the first forward either way."""
    import importlib.util

    import torch
    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False
    if not torch.cuda.is_available() and not getattr(mla.RotaryEmbedding, "_megarl_host_init", False):
        for name in ("RotaryEmbedding", "YarnRotaryEmbedding"):
            base = getattr(mla, name)
            setattr(mla, name, type(name, (base,), {"_megarl_host_init": True, "__init__": _host_init(base)}))


def _host_init(base):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("use_cpu_initialization", True)
        base.__init__(self, *args, **kwargs)

    return __init__


def local_down_projection():
    """The local spec's q / kv down projections: megatron's plain (replicated) `Linear`, as
    Transformer Engine's spec has a duplicated linear there. megatron's local default, a
    column-parallel linear whose output is gathered over TP, gets the shared rotary key wrong in
    the backward: each TP rank's heads add to k_rope's gradient, and the gather's backward keeps
    only the local rank's part of the columns it owns (the logits are right, the gradients of
    kv_a_proj_with_mqa and everything before it are not). With the replicated linear under sequence
    parallelism megatron all-gathers k_rope over the sequence, whose backward sums the heads of
    every rank, and all-reduces the weight's gradient over TP (`sequence_parallel` on it). MoE
    models train at TP > 1 only with sequence parallelism, which the MLA families here all are."""
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


# megatron suffix (after `decoder.layers.N.`) -> (HF suffixes after `model.layers.N.`, layout).
# "col" rows split over TP; a duplicated (TE) linear's weight is replicated (bridge.map_param).
MLA_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), "col"),
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), "col"),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), "replicated"),
    "self_attention.linear_q_up_proj.layer_norm_weight": (("self_attn.q_a_layernorm.weight",), "replicated"),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), "col"),
    "self_attention.linear_kv_down_proj.weight": (("self_attn.kv_a_proj_with_mqa.weight",), "col"),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), "replicated"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (("self_attn.kv_a_layernorm.weight",), "replicated"),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), "col"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
}


def mla_hf_shapes(m: MLASpec, hidden: int, heads: int) -> dict[str, tuple[int, ...]]:
    """HF attention tensors of one layer (names after `model.layers.N.`)."""
    out = {"self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, hidden),
           "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
           "self_attn.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
           "self_attn.o_proj.weight": (hidden, heads * m.v_head_dim)}
    if m.q_lora_rank:
        out.update({"self_attn.q_a_proj.weight": (m.q_lora_rank, hidden),
                    "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
                    "self_attn.q_b_proj.weight": (heads * m.q_head_dim, m.q_lora_rank)})
    else:
        out["self_attn.q_proj.weight"] = (heads * m.q_head_dim, hidden)
    return out
