"""Hybrid linear-attention families: Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5` dense,
`qwen3_5_moe`; vision-language) in megarl's family registry.

Their decoder layers are of two kinds, listed by `config.layer_types` (three of every four
"linear_attention" in the released models):
- gated delta-net layers (`megarl.models.gdn`, `ArchSpec.gdn` = its `GDNSpec`);
- full attention layers: Qwen3 attention (q/k RMSNorm per head, GQA) whose q_proj also yields a
  per-head output gate, o = o_proj(attention * sigmoid(gate)) (megatron's `attention_output_gate`),
  and RoPE on the first `partial_rotary_factor` (0.25) of each head.
Every RMSNorm outside the delta-net's gated norm is zero-centred, y = x / rms(x) * (1 + w) (HF's
`Qwen3NextRMSNorm`; megatron's `layernorm_zero_centered_gamma`, whose weights are then HF's exactly).
MoE layers (Qwen3-Next, Qwen3.5-MoE, every layer): top-k softmax routing, top-k weights
renormalised (Qwen3.5-MoE's router always renormalises), plus a shared expert scaled by
sigmoid(shared_expert_gate . h), as Qwen2-MoE. Qwen3.5 adds the Qwen3-VL vision tower without
DeepStack and interleaved M-RoPE over the rotated quarter of each head. HF names: `hybrid_bridge`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megarl.models.families import ArchSpec, UnsupportedModelError, register_family
from megarl.models.gdn import GDNSpec
from megarl.models.rope import hf_rope_parameters

LAYER_KINDS = ("linear_attention", "full_attention")


def _require(cond: bool, model_type: str, what: str) -> None:
    if not cond:
        raise UnsupportedModelError(f"model_type={model_type!r}: {what} is not supported")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, None)
    return default if value is None else value


def gdn_spec(text: Any, model_type: str, hf_layout: str) -> GDNSpec:
    """The GDNSpec of a text config (Qwen3NextConfig / Qwen3_5(Moe)TextConfig)."""
    kinds = list(_get(text, "layer_types", []))
    _require(len(kinds) == int(text.num_hidden_layers) and set(kinds) <= set(LAYER_KINDS), model_type,
             f"layer_types={kinds} (need one of {LAYER_KINDS} per layer)")
    nk, nv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    _require(nv % nk == 0, model_type, f"linear_num_value_heads={nv} not a multiple of linear_num_key_heads={nk}")
    _require(_get(text, "hidden_act", "silu") == "silu", model_type, f"hidden_act={text.hidden_act!r}")
    return GDNSpec(linear_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
                   conv_kernel=int(text.linear_conv_kernel_dim), key_head_dim=int(text.linear_key_head_dim),
                   value_head_dim=int(text.linear_value_head_dim), num_key_heads=nk, num_value_heads=nv,
                   hf_layout=hf_layout)


def hybrid_lm(text: Any, model_type: str, hf_layout: str, ffn: int) -> ArchSpec:
    """The LM facts shared by the three families (module doc), dense MLP of width `ffn`."""
    params = hf_rope_parameters(text)
    _require(params["rope_type"] == "default", model_type, f"rope type {params['rope_type']!r}")
    _require(not _get(text, "attention_bias", False), model_type, "attention_bias=True")
    heads, groups = int(text.num_attention_heads), int(text.num_key_value_heads)
    _require(heads % groups == 0, model_type, f"{heads} heads over {groups} key/value heads")
    head_dim = int(_get(text, "head_dim", text.hidden_size // heads))
    rotary = float(params.get("partial_rotary_factor") or 1.0)
    _require(0 < rotary <= 1 and int(head_dim * rotary) % 2 == 0, model_type, f"partial_rotary_factor={rotary}")
    return ArchSpec(
        model_type=model_type, num_layers=int(text.num_hidden_layers), hidden_size=int(text.hidden_size),
        ffn_hidden_size=ffn, num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
        vocab_size=int(text.vocab_size), max_position_embeddings=int(text.max_position_embeddings),
        rms_norm_eps=float(text.rms_norm_eps), rope_theta=float(params["rope_theta"]), add_qkv_bias=False,
        qk_layernorm=True, tie_word_embeddings=bool(_get(text, "tie_word_embeddings", False)),
        init_std=float(_get(text, "initializer_range", 0.02)),
        attention_dropout=float(_get(text, "attention_dropout", 0.0)), rotary_percent=rotary,
        gdn=gdn_spec(text, model_type, hf_layout), attention_output_gate=True, zero_centered_norm=True,
        hf_rules=hf_layout)


def _with_moe(lm: ArchSpec, text: Any, model_type: str, always_renormalise: bool) -> ArchSpec:
    n, topk = int(_get(text, "num_experts", 0)), int(_get(text, "num_experts_per_tok", 0))
    _require(n > 1 and 0 < topk <= n, model_type, f"num_experts={n}, num_experts_per_tok={topk}")
    _require(_get(text, "decoder_sparse_step", 1) == 1 and not _get(text, "mlp_only_layers", None), model_type,
             "dense MLP layers between MoE layers (decoder_sparse_step / mlp_only_layers)")
    shared = int(_get(text, "shared_expert_intermediate_size", 0))
    return dataclasses.replace(
        lm, num_experts=n, moe_topk=topk, moe_ffn_hidden_size=int(text.moe_intermediate_size),
        norm_topk_prob=always_renormalise or bool(_get(text, "norm_topk_prob", True)),
        shared_expert_ffn_hidden_size=shared, mtp_layers=int(_get(text, "mtp_num_hidden_layers", 0)))


@register_family("qwen3_next")
def qwen3_next(hf_config: Any) -> ArchSpec:
    """Qwen3-Next (80B-A3B): hybrid gated delta-net / gated attention, MoE with a gated shared expert."""
    lm = hybrid_lm(hf_config, "qwen3_next", "qwen3_next", int(hf_config.intermediate_size))
    return _with_moe(lm, hf_config, "qwen3_next", always_renormalise=False)


def _qwen3_5(hf_config: Any, lm: ArchSpec) -> ArchSpec:
    """The hybrid LM `lm` with the Qwen3-VL tower (no DeepStack), interleaved M-RoPE over the rotated
    part of each head, HF's `model.language_model.` names."""
    from megarl.models.vision.qwen3_vl_spec import qwen3_vision_spec

    model_type = hf_config.model_type
    rope = _get(hf_config.text_config, "rope_parameters", {}) or {}
    section = tuple(int(x) for x in rope.get("mrope_section") or ())
    rotated = int(lm.head_dim * lm.rotary_percent)
    _require(len(section) == 3 and sum(section) == rotated // 2, model_type,
             f"mrope_section={list(section)} (need 3 sections summing to the rotated head_dim/2 = {rotated // 2})")
    _require(bool(rope.get("mrope_interleaved", True)), model_type, "mrope_interleaved=False")
    vision = qwen3_vision_spec(hf_config)
    _require(not vision.deepstack_visual_indexes, model_type, "DeepStack features")
    _require(vision.out_hidden_size == lm.hidden_size, model_type,
             f"vision out_hidden_size={vision.out_hidden_size} != text hidden_size={lm.hidden_size}")
    return dataclasses.replace(lm, model_type=model_type, mrope_section=section, vision=vision,
                               hf_prefix="model.language_model.",
                               tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)))


@register_family("qwen3_5", vision_language=True)
def qwen3_5(hf_config: Any) -> ArchSpec:
    """Qwen3.5 dense (27B): the hybrid LM of `text_config` with a dense MLP, plus the vision tower."""
    text = hf_config.text_config
    return _qwen3_5(hf_config, hybrid_lm(text, "qwen3_5", "qwen3_5", int(text.intermediate_size)))


@register_family("qwen3_5_moe", vision_language=True)
def qwen3_5_moe(hf_config: Any) -> ArchSpec:
    """Qwen3.5-MoE (35B-A3B, 397B-A17B): the hybrid MoE LM of `text_config` plus the vision tower."""
    text = hf_config.text_config
    lm = hybrid_lm(text, "qwen3_5_moe", "qwen3_5", 0)
    return _qwen3_5(hf_config, _with_moe(lm, text, "qwen3_5_moe", always_renormalise=True))


def prepare_megatron_output_gate() -> None:
    """megatron-core 0.16.1 compiles the attention output gate (`Attention._apply_output_gate`,
    `jit_fuser` = torch.compile) at import; under megarl's CPU runtime dynamo fails to build its
    guards (the runtime's torch-function mode), so without CUDA the plain function runs instead
    (the same arithmetic: x * sigmoid(gate) in float32, cast back)."""
    import torch
    from megatron.core.transformer.attention import Attention

    original = getattr(Attention.__dict__["_apply_output_gate"], "_torchdynamo_orig_callable", None)
    if original is not None and not torch.cuda.is_available():
        Attention._apply_output_gate = original

