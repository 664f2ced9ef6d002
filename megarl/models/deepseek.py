"""The DeepSeek-V3 family (`deepseek_v3`; Kimi-K2's `kimi_k2` is the same architecture) and GLM-4.5
(`glm4_moe`) on megatron-core: their `ArchSpec`s and HF naming.

Both route as transformers 5.19's `DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`:

    s = sigmoid(x W_gate^T) (fp32);  choice = s + b     (b = e_score_correction_bias, fp32 buffer)
    groups: the n_group groups of E / n_group experts are scored by the sum of their top-2 choice
            values; only the topk_group best groups compete
    e = top-k(choice);  w = s[e] / (sum s[e] + 1e-20) * routed_scaling_factor
    y = sum_j w_j expert_{e_j}(x) + shared_experts(x)      (no gate on the shared expert)

and the first `first_k_dense_replace` layers have a dense MLP instead. megatron-core 0.16.1 does
the same with `moe_router_score_function="sigmoid"`, `moe_router_enable_expert_bias` (the bias is
the router's `expert_bias` buffer), `moe_router_num_groups` / `moe_router_group_topk`,
`moe_router_topk_scaling_factor` and `moe_layer_freq`, except where it cannot, which is refused
here: megatron renormalises sigmoid top-k weights always (HF only with `norm_topk_prob`) and
scores a group by its top-(k / topk_group) experts (HF by its top 2).

The selection bias in RL: megatron would move it after every step by its aux-loss-free balancing
rule (`moe_router_bias_update_rate`); megarl keeps it frozen by default
(`model.moe_expert_bias_update_rate: 0`): a buffer loaded from HF, streamed to the engines and
saved with the model, never touched by the optimizer, so the policy's routing changes only
through the trained router weights (a bias that chases the rollout's load would move the
routing of every token between steps for a reason the loss does not see).

DeepSeek-V3 attention is multi-latent (`megarl.models.mla`); GLM-4.5 has standard GQA attention
with q/k/v biases (`attention_bias`), optional per-head q/k RMSNorm (`use_qk_norm`) and RoPE on the
first half of each head (`partial_rotary_factor` 0.5, not interleaved).

Multi-token-prediction layers (`num_nextn_predict_layers`: HF layers num_hidden_layers, ...) are
not part of the decoder megarl trains: the import skips them (`mtp_names`, logged) and an export
does not write them.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.models.bridge import _EXPERT_RULES, FAMILY_RULES, FamilyRules, outer_hf_shapes
from megarl.models.families import ArchSpec, UnsupportedModelError, register_family
from megarl.models.mla import MLA_RULES, MLASpec, mla_hf_shapes
from megarl.models.rope import hf_rope_parameters
from megarl.models.yarn import yarn_settings


def _require(cond: bool, hf_config: Any, what: str) -> None:
    if not cond:
        raise UnsupportedModelError(f"model_type={hf_config.model_type!r}: {what} is not supported")


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, None)
    return default if value is None else value


def _routing(hf_config: Any, layers: int) -> dict:
    """The MoE fields of the ArchSpec (module docstring), refusing what megatron routes otherwise."""
    experts = int(_get(hf_config, "n_routed_experts", 0))
    topk = int(hf_config.num_experts_per_tok)
    _require(experts > 1 and 1 < topk <= experts, hf_config, f"n_routed_experts={experts}, num_experts_per_tok={topk}")
    _require(_get(hf_config, "scoring_func", "sigmoid") == "sigmoid", hf_config, "scoring_func != 'sigmoid'")
    _require(bool(_get(hf_config, "norm_topk_prob", True)), hf_config,
             "norm_topk_prob=False (megatron renormalises sigmoid top-k weights)")
    n_group, topk_group = int(_get(hf_config, "n_group", 1)), int(_get(hf_config, "topk_group", 1))
    grouped = 1 < n_group and topk_group < n_group  # all groups kept = no group limit
    if grouped:
        _require(experts % n_group == 0 and topk % topk_group == 0 and topk // topk_group == 2, hf_config,
                 f"n_group={n_group}, topk_group={topk_group} with top-{topk} (megatron scores a group by its "
                 "top-(k / topk_group) experts, HF by its top 2)")
    shared = int(_get(hf_config, "n_shared_experts", 0))
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
                norm_topk_prob=True, shared_expert_ffn_hidden_size=int(hf_config.moe_intermediate_size) * shared,
                moe_score_function="sigmoid", moe_expert_bias=True, moe_num_groups=n_group if grouped else 0,
                moe_group_topk=topk_group if grouped else 0,
                moe_scaling_factor=float(_get(hf_config, "routed_scaling_factor", 1.0)),
                moe_first_dense=min(int(_get(hf_config, "first_k_dense_replace", 0)), layers),
                shared_expert_gated=False, mtp_layers=int(_get(hf_config, "num_nextn_predict_layers", 0)))


def _base(hf_config: Any, **fields) -> ArchSpec:
    _require(_get(hf_config, "hidden_act", "silu") == "silu", hf_config, f"hidden_act={hf_config.hidden_act!r}")
    layers = int(hf_config.num_hidden_layers)
    params = hf_rope_parameters(hf_config)
    return ArchSpec(
        model_type=hf_config.model_type, num_layers=layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=float(params["rope_theta"]),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
        attention_dropout=float(_get(hf_config, "attention_dropout", 0.0)),
        **_routing(hf_config, layers), **fields)


@register_family("deepseek_v3")
def deepseek_v3(hf_config: Any) -> ArchSpec:
    """DeepSeek-V3 / R1, Kimi-K2: multi-latent attention (YaRN or plain RoPE), sigmoid-routed MoE
    with selection bias, groups, a routed scaling factor, shared experts, dense first layers."""
    _require(not _get(hf_config, "attention_bias", False), hf_config, "attention_bias=True")
    _require(bool(_get(hf_config, "rope_interleave", True)), hf_config, "rope_interleave=False")
    params = hf_rope_parameters(hf_config)
    rope = params["rope_type"]
    _require(rope in ("default", "yarn"), hf_config, f"rope type {rope!r} with multi-latent attention")
    try:
        yarn = yarn_settings(params, hf_config.max_position_embeddings) if rope == "yarn" else None
    except ValueError as e:
        raise UnsupportedModelError(f"model_type={hf_config.model_type!r}: {e}") from e
    mla = MLASpec(q_lora_rank=int(_get(hf_config, "q_lora_rank", 0)), kv_lora_rank=int(hf_config.kv_lora_rank),
                  qk_nope_head_dim=int(hf_config.qk_nope_head_dim), qk_rope_head_dim=int(hf_config.qk_rope_head_dim),
                  v_head_dim=int(hf_config.v_head_dim), yarn=yarn)
    heads = int(hf_config.num_attention_heads)
    return _base(hf_config, num_query_groups=heads, head_dim=mla.q_head_dim, add_qkv_bias=False,
                 qk_layernorm=False, mla=mla, hf_rules="deepseek_v3")


register_family("kimi_k2")(deepseek_v3)


@register_family("glm4_moe")
def glm4_moe(hf_config: Any) -> ArchSpec:
    """GLM-4.5 / GLM-4.5-Air: GQA with q/k/v biases (no o bias), optional q/k norms, partial RoPE,
    sigmoid-routed MoE as DeepSeek-V3 (module docstring)."""
    params = hf_rope_parameters(hf_config)
    _require(params["rope_type"] == "default", hf_config, f"rope type {params['rope_type']!r}")
    heads, groups = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    _require(heads % groups == 0, hf_config, f"{heads} heads over {groups} key/value heads")
    head_dim = int(_get(hf_config, "head_dim", hf_config.hidden_size // heads))
    rotary = float(params.get("partial_rotary_factor") or 1.0)
    _require(int(head_dim * rotary) % 2 == 0 and 0 < rotary <= 1, hf_config, f"partial_rotary_factor={rotary}")
    return _base(hf_config, num_query_groups=groups, head_dim=head_dim,
                 add_qkv_bias=bool(_get(hf_config, "attention_bias", False)),
                 qk_layernorm=bool(_get(hf_config, "use_qk_norm", False)), rotary_percent=rotary, hf_rules="glm4_moe")


def prepare_megatron_routers() -> None:
    """megatron-core 0.16.1 wraps the router's `_apply_expert_bias` (a token count per expert, the
    input of its bias update) in `torch.compile` at import; under megarl's CPU runtime dynamo fails
    to build its guards (the runtime's torch-function mode). Without CUDA the plain function runs
    instead (the same arithmetic; compiling a one-line count gains nothing there)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    compiled = TopKRouter.__dict__["_apply_expert_bias"]
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    if original is not None and not torch.cuda.is_available():
        TopKRouter._apply_expert_bias = original


# ---------------------------------------------------------------- HF naming

MOE_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
    "mlp.router.expert_bias": (("mlp.gate.e_score_correction_bias",), "replicated"),
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "fc1"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), "row"),
}


def _mlp_shapes(spec: ArchSpec, moe: bool) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    if not moe:
        f = spec.ffn_hidden_size
        return {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    fe, fs = spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
    out = {"mlp.gate.weight": (spec.num_experts, h), "mlp.gate.e_score_correction_bias": (spec.num_experts,)}
    for g in range(spec.num_experts):
        out.update({f"mlp.experts.{g}.{n}": s for n, s in
                    (("gate_proj.weight", (fe, h)), ("up_proj.weight", (fe, h)), ("down_proj.weight", (h, fe)))})
    if fs:
        out.update({"mlp.shared_experts.gate_proj.weight": (fs, h), "mlp.shared_experts.up_proj.weight": (fs, h),
                    "mlp.shared_experts.down_proj.weight": (h, fs)})
    return out


def _attention_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.mla is not None:
        return mla_hf_shapes(spec.mla, h, heads)
    d, g = spec.head_dim, spec.num_query_groups
    out = {"self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (g * d, h),
           "self_attn.v_proj.weight": (g * d, h), "self_attn.o_proj.weight": (h, heads * d)}
    if spec.add_qkv_bias:
        out.update({"self_attn.q_proj.bias": (heads * d,), "self_attn.k_proj.bias": (g * d,),
                    "self_attn.v_proj.bias": (g * d,)})
    if spec.qk_layernorm:
        out.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return out


def expected_shapes(spec: ArchSpec, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the decoder (multi-token-prediction layers excluded) with its shape."""
    h, prefix = spec.hidden_size, spec.hf_prefix
    shapes = outer_hf_shapes(spec, value_head)
    for i in range(spec.num_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), **_attention_shapes(spec),
                 **_mlp_shapes(spec, i >= spec.moe_first_dense)}
        shapes.update({f"{prefix}layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


FAMILY_RULES["deepseek_v3"] = FamilyRules({**MLA_RULES, **MOE_RULES}, expected_shapes)
FAMILY_RULES["glm4_moe"] = FamilyRules(dict(MOE_RULES), expected_shapes)
assert set(_EXPERT_RULES) == {"linear_fc1.weight", "linear_fc2.weight"}  # routed experts: the default naming
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def mtp_names(names, spec: ArchSpec) -> set[str]:
    """The names among `names` of the multi-token-prediction layers (HF layer index >= num_layers, or
    under `mtp.`)."""
    if not spec.mtp_layers:
        return set()
    prefix = spec.hf_prefix
    out = set()
    for n in names:
        if n.startswith("mtp."):  # Qwen3-Next / Qwen3.5 keep them apart
            out.add(n)
            continue
        m = _LAYER_INDEX.match(n[len(prefix):]) if n.startswith(prefix) else None
        if m and int(m.group(1)) >= spec.num_layers:
            out.add(n)
    return out


def register_kimi_config() -> None:
    """Kimi-K2's config.json says model_type "kimi_k2" (a DeepSeek-V3 with another tokenizer), which
    transformers does not know: AutoConfig / AutoModelForCausalLM read it as DeepSeek-V3 here."""
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_k2" in CONFIG_MAPPING:
        return

    class KimiK2Config(DeepseekV3Config):
        model_type = "kimi_k2"

    class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
        config_class = KimiK2Config

    AutoConfig.register("kimi_k2", KimiK2Config)
    AutoModelForCausalLM.register(KimiK2Config, KimiK2ForCausalLM)

