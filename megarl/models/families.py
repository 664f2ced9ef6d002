"""Model-family registry: HF `config.model_type` -> how to build and map a Megatron GPTModel.

A family turns an HF `PretrainedConfig` into `ArchSpec`, the architecture facts megatron-core
needs (head layout, biases, q/k norms, RoPE, experts). The dense families (Qwen2/2.5, Qwen3,
Llama 3) and the MoE families (Qwen3-MoE, Qwen2-MoE with its sigmoid-gated shared expert) share
one weight bridge (`megarl.models.bridge`); they differ only in the facts extracted here.
DeepSeek-V3 / Kimi-K2 (multi-latent attention) and GLM-4.5 live in `megarl.models.deepseek` with
their own HF naming rules. New families register with `@register_family("model_type")`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.models.rope import SUPPORTED_ROPE_TYPES, partial_rotary_factor, rope_params, rope_type_of
from megarl.registry import Registry


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or option megarl cannot build."""


@dataclass(frozen=True)
class ArchSpec:
    """Architecture facts of a dense decoder-only LM, in Megatron terms."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int  # megatron kv_channels; may differ from hidden_size / num_attention_heads
    vocab_size: int  # true (HF) vocabulary size, before TP padding
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    add_qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    init_std: float
    attention_dropout: float
    # Mixture of experts (0 experts = dense MLP in every layer). Routing as HF Qwen-MoE:
    # p = softmax(router logits) in fp32, the top `moe_topk` experts, p renormalised over them
    # when `norm_topk_prob`; a shared expert (when its size > 0) adds sigmoid(gate . h) * MLP(h).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_ffn_hidden_size: int = 0
    # DeepSeek-V3 / Kimi-K2 / GLM-4.5 MoE (megarl.models.deepseek): scores sigmoid(logits), chosen
    # with a per-expert selection bias (HF e_score_correction_bias, megatron expert_bias) from the
    # best `moe_group_topk` of `moe_num_groups` expert groups (0 = no groups), the chosen scores
    # renormalised and times `moe_scaling_factor`; the first `moe_first_dense` layers dense; the
    # shared expert without a gate when not `shared_expert_gated`.
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_num_groups: int = 0
    moe_group_topk: int = 0
    moe_scaling_factor: float = 1.0
    moe_first_dense: int = 0
    shared_expert_gated: bool = True
    # Attention variants: the rotated fraction of each head (GLM-4.5: 0.5) and multi-latent
    # attention (a `megarl.models.mla.MLASpec`; None = standard attention)
    rotary_percent: float = 1.0
    mla: Any = None
    # HF naming: "" = the Qwen / Llama rules of megarl.models.bridge, else a rule set registered in
    # bridge.FAMILY_RULES; HF layers past num_layers (multi-token prediction) are skipped on load
    hf_rules: str = ""
    mtp_layers: int = 0
    # Vision-language models (megarl.models.vision): M-RoPE sections [t, h, w] of head_dim / 2
    # (None = plain 1-D RoPE) and the vision tower's facts (a `VisionSpec`; None = text only).
    mrope_section: tuple[int, ...] | None = None
    vision: Any = None
    # HF checkpoint naming: prefix of the LM's tensors (`model.language_model.` in Qwen3-VL) and
    # whether each layer's experts are two fused tensors (`megarl.models.vision.qwen3_vl_bridge`)
    hf_prefix: str = "model."
    hf_fused_experts: bool = False
    # Hybrid linear attention (Qwen3-Next, Qwen3.5: megarl.models.hybrid): the gated delta-net layers
    # (a `megarl.models.gdn.GDNSpec`; None = attention in every layer), a sigmoid output gate on the
    # full-attention heads, zero-centred RMSNorm weights (y = x / rms(x) * (1 + w))
    gdn: Any = None
    attention_output_gate: bool = False
    zero_centered_norm: bool = False


FAMILIES = Registry("model family")  # HF model_type -> fn(hf_config) -> ArchSpec
_VISION_LANGUAGE: set[str] = set()


def register_family(model_type: str, *, vision_language: bool = False):
    """Registers `fn(hf_config) -> ArchSpec` for HF configs whose `model_type` is `model_type`
    (vision_language: listed apart in error messages)."""
    if vision_language:
        _VISION_LANGUAGE.add(model_type)
    return FAMILIES.register(model_type)


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def arch_spec(hf_config: Any) -> ArchSpec:
    """The ArchSpec for an HF config; unsupported `model_type` -> UnsupportedModelError."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={getattr(hf_config, 'architectures', None)}); "
            f"supported model_type values: {[t for t in supported_model_types() if t not in _VISION_LANGUAGE]}"
            f" (vision-language: {sorted(_VISION_LANGUAGE)})"
        )
    return FAMILIES[model_type](hf_config)


def _require(cond: bool, hf_config: Any, what: str) -> None:
    if not cond:
        raise UnsupportedModelError(f"model_type={hf_config.model_type!r}: {what} is not supported")


def _common(hf_config: Any, *, head_dim: int, add_qkv_bias: bool, qk_layernorm: bool) -> ArchSpec:
    _require(getattr(hf_config, "hidden_act", "silu") == "silu", hf_config,
             f"hidden_act={getattr(hf_config, 'hidden_act', None)!r} (only 'silu')")
    layer_types = getattr(hf_config, "layer_types", None) or []
    _require(all(t == "full_attention" for t in layer_types), hf_config,
             "sliding-window attention (layer_types contains 'sliding_attention')")
    _require(partial_rotary_factor(hf_config) == 1.0, hf_config, "partial_rotary_factor != 1")
    rope = rope_type_of(hf_config)
    _require(rope in SUPPORTED_ROPE_TYPES, hf_config,
             f"rope_scaling type {rope!r} (supported: {sorted(SUPPORTED_ROPE_TYPES)})")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    _require(heads % groups == 0, hf_config,
             f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}")
    return ArchSpec(
        model_type=hf_config.model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_params(hf_config).theta,
        add_qkv_bias=add_qkv_bias,
        qk_layernorm=qk_layernorm,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=float(getattr(hf_config, "initializer_range", 0.02)),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
    )


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@register_family("qwen2")
def qwen2(hf_config: Any) -> ArchSpec:
    """Qwen2 / Qwen2.5: biases on q/k/v (not o), GQA, SwiGLU, RMSNorm."""
    return _common(hf_config, head_dim=hf_config.hidden_size // hf_config.num_attention_heads,
                   add_qkv_bias=True, qk_layernorm=False)


@register_family("qwen3")
def qwen3(hf_config: Any) -> ArchSpec:
    """Qwen3 dense: RMSNorm on q and k per head, explicit head_dim, no biases by default."""
    _require(not getattr(hf_config, "attention_bias", False), hf_config, "attention_bias=True")
    return _common(hf_config, head_dim=_head_dim(hf_config), add_qkv_bias=False, qk_layernorm=True)


@register_family("llama")
def llama(hf_config: Any) -> ArchSpec:
    """Llama 2/3/3.x: no biases, GQA, optional llama3 RoPE scaling, tied or untied embeddings."""
    # HF's attention_bias also puts a bias on o_proj, which megatron cannot express without
    # biases on every linear layer; mlp_bias likewise.
    _require(not getattr(hf_config, "attention_bias", False), hf_config, "attention_bias=True")
    _require(not getattr(hf_config, "mlp_bias", False), hf_config, "mlp_bias=True")
    return _common(hf_config, head_dim=_head_dim(hf_config), add_qkv_bias=False, qk_layernorm=False)


def _moe(hf_config: Any, dense: ArchSpec, shared_expert_ffn: int) -> ArchSpec:
    import dataclasses

    n = int(getattr(hf_config, "num_experts", 0) or 0)
    _require(n > 1, hf_config, f"num_experts={n} (an MoE family needs >= 2 experts)")
    # megatron's moe_layer_freq could express dense layers in between; not wired (no model uses it)
    _require(getattr(hf_config, "decoder_sparse_step", 1) == 1, hf_config, "decoder_sparse_step != 1")
    _require(not getattr(hf_config, "mlp_only_layers", None), hf_config, "mlp_only_layers (dense layers)")
    topk = int(hf_config.num_experts_per_tok)
    _require(0 < topk <= n, hf_config, f"num_experts_per_tok={topk} with {n} experts")
    return dataclasses.replace(
        dense, num_experts=n, moe_topk=topk, moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=shared_expert_ffn)


@register_family("qwen3_moe")
def qwen3_moe(hf_config: Any) -> ArchSpec:
    """Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B): Qwen3 attention, every MLP a top-k softmax MoE."""
    return _moe(hf_config, qwen3(hf_config), shared_expert_ffn=0)


@register_family("qwen2_moe")
def qwen2_moe(hf_config: Any) -> ArchSpec:
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias when
    `qkv_bias`), top-k softmax MoE (no renormalisation by default) plus a shared expert scaled
    by sigmoid(shared_expert_gate . h)."""
    bias = bool(getattr(hf_config, "qkv_bias", True))
    dense = _common(hf_config, head_dim=hf_config.hidden_size // hf_config.num_attention_heads,
                    add_qkv_bias=bias, qk_layernorm=False)
    return _moe(hf_config, dense, shared_expert_ffn=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0))
