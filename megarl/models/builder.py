"""HF config -> megatron-core TransformerConfig + layer spec + GPTModel chunk(s).

TP/PP sizes and pre/post-process flags come from `megatron.core.parallel_state`, so call
`megarl.parallel.distributed.init_distributed` first. Two layer implementations:
"local" (megatron's own modules with megarl's core attention; CPU and GPU) and "te" = "transformer_engine" (Transformer
Engine; GPU only, verified only on GPU).

Vocabulary padding: the embedding and output layer hold `padded_vocab_size(V, tp, d)` rows
(a multiple of `d * tp`, d=128 like Megatron-LM). The padded rows are zero after an HF import,
and `mask_padded_vocab=True` (default) sets the padded logit columns to `PADDED_VOCAB_LOGIT`,
so softmax / cross-entropy / log-probs over the padded vocabulary equal those over the HF
vocabulary. Exports strip the padding (`megarl.models.bridge`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megarl.models.families import ArchSpec, arch_spec
from megarl.models.rope import hf_inv_freq
from megarl.parallel.distributed import device

# exp(-1e4 - max) underflows to exactly 0 in fp32/bf16/fp16 while p*log(p) stays finite (0),
# unlike -inf, which turns entropy terms into NaN.
PADDED_VOCAB_LOGIT = -1.0e4
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {sorted(_DTYPES)})")
    return _DTYPES[dtype]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of `divisible_by * tp` that is >= vocab_size."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(spec: ArchSpec, *, dtype: torch.dtype = torch.float32,
                       overrides: dict | None = None):
    """The megatron TransformerConfig for `spec` at the current parallel_state sizes.

    `overrides` are extra TransformerConfig fields (recompute, sequence_parallel, fp8, ...)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=spec.attention_dropout,
        init_method_std=spec.init_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        use_cpu_initialization=not on_gpu,
        # RL batches vary in length; allgather MoE dispatch rejects variable lengths
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    overrides = dict(overrides or {})
    if spec.num_experts:
        kwargs.update(moe_config_fields(spec), expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                      expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())
        _define_missing_te_gemm()
    else:  # MoE options of a run config (aux loss, routing replay) mean nothing to a dense model
        overrides = {k: v for k, v in overrides.items() if not k.startswith("moe_")}
    if spec.mrope_section:  # M-RoPE of vision-language models (megarl.models.vision)
        kwargs["mrope_section"] = list(spec.mrope_section)
    if spec.gdn is not None:  # hybrid linear attention (megarl.models.hybrid)
        from megarl.models.hybrid import prepare_megatron_output_gate

        prepare_megatron_output_gate()
        linear = set(spec.gdn.linear_layers)  # megatron's pattern (1 = linear attention): per-layer checkpoint keys
        kwargs.update(layernorm_zero_centered_gamma=spec.zero_centered_norm,
                      attention_output_gate=spec.attention_output_gate,
                      linear_attention_freq=[int(i in linear) for i in range(spec.num_layers)])
    config_class = TransformerConfig
    if spec.mla is not None:  # multi-latent attention (megarl.models.mla)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from megarl.models.mla import mla_config_fields, prepare_megatron_mla

        prepare_megatron_mla()
        config_class = MLATransformerConfig
        kwargs.update(mla_config_fields(spec.mla, spec.rope_theta))
    kwargs.update(overrides)
    if kwargs.get("fp8"):  # a recipe this GPU cannot run fails here, not in TE's first autocast
        from megarl.models.fp8 import check_fp8_recipe

        recipe = kwargs.get("fp8_recipe", "delayed")
        check_fp8_recipe(getattr(recipe, "value", recipe))
    return config_class(**kwargs)


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating linear tests `te_general_gemm is not None`, a name
    it only binds when Transformer Engine imports (NameError otherwise, CPU or GPU); without TE
    it is None, which selects megatron's own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_config_fields(spec: ArchSpec) -> dict[str, Any]:
    """TransformerConfig MoE fields reproducing HF Qwen-MoE routing (`ArchSpec` doc), and
    DeepSeek-V3 / GLM-4.5's (megarl.models.deepseek): sigmoid scores, the selection bias as
    megatron's expert_bias buffer (not updated: moe_router_bias_update_rate 0 unless the trainer's
    overrides set model.moe_expert_bias_update_rate), expert groups, the routed scaling factor,
    dense first layers (moe_layer_freq), an ungated shared expert.

    norm_topk_prob: softmax over the top-k logits == top-k of softmax(logits) renormalised
    (megatron's post-softmax routing); otherwise softmax over all experts before top-k
    (moe_router_pre_softmax). The router runs in fp32; no load-balancing loss unless the
    trainer's overrides ask for one (RL default); sequential (not grouped) experts."""
    shared = spec.shared_expert_ffn_hidden_size
    fields = dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_topk,
        moe_router_score_function=spec.moe_score_function,
        moe_router_pre_softmax=not spec.norm_topk_prob and spec.moe_score_function == "softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared) and spec.shared_expert_gated,
    )
    if spec.moe_expert_bias:  # DeepSeek-V3 / GLM-4.5 (megarl.models.deepseek): a frozen selection bias
        from megarl.models.deepseek import prepare_megatron_routers

        prepare_megatron_routers()
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if spec.moe_num_groups:
        fields.update(moe_router_num_groups=spec.moe_num_groups, moe_router_group_topk=spec.moe_group_topk)
    if spec.moe_scaling_factor != 1.0:
        fields["moe_router_topk_scaling_factor"] = spec.moe_scaling_factor
    if spec.moe_first_dense:  # dense MLPs in the first layers
        k = spec.moe_first_dense
        fields["moe_layer_freq"] = [0] * k + [1] * (spec.num_layers - k)
    return fields


def layer_spec(spec: ArchSpec, impl: str = "local", dense: bool = False):
    """Layer spec: Transformer Engine ("te" / "transformer_engine": fused norms in linear_qkv /
    linear_fc1; verified only on GPU) or "local": megatron's local modules with megarl's core
    attention (`megarl.models.attention.LocalAttention`: packed sequences, context parallelism,
    memory linear in the sequence length). Multi-latent attention when `spec.mla` (its q / kv
    latent norms are megarl's RMSNorm in the local spec); dense=True: a dense MLP even in an MoE
    model (its first `moe_first_dense` layers)."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = None if dense else spec.num_experts or None
    mla = spec.mla is not None
    if impl in ("te", "transformer_engine"):
        if not te_available():
            raise RuntimeError("impl='te' needs Transformer Engine (not importable here); use impl='local'")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm or mla,
            multi_latent_attention=mla)
    if impl != "local":
        raise ValueError(f"impl must be 'local', 'te' or 'transformer_engine', got {impl!r}")
    from megarl.models.attention import LocalAttention

    from megarl.models.norm import RMSNorm

    lspec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=spec.qk_layernorm or mla, multi_latent_attention=mla)
    sub = lspec.submodules
    attn = sub.self_attention.submodules
    attn.core_attention = LocalAttention
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm  # sequence-parallel capable (megarl.models.norm)
    if mla:
        from megarl.models.mla import LatentRMSNorm, local_down_projection

        attn.q_layernorm = attn.kv_layernorm = LatentRMSNorm
        attn.linear_q_down_proj = attn.linear_kv_down_proj = local_down_projection()
    elif spec.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    return lspec


def gdn_layer_spec(spec: ArchSpec, impl: str = "local"):
    """The layer spec of a gated delta-net layer (`megarl.models.gdn`): the model's layer spec with
    the delta-net as its token mixer (megarl's module under both specs; its input norm is megarl's
    RMSNorm, as TE's fused one sits in the attention projection the delta-net does not have)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.models.gdn import GatedDeltaNet
    from megarl.models.norm import RMSNorm

    lspec = layer_spec(spec, impl)
    lspec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"gdn": spec.gdn})
    lspec.submodules.input_layernorm = RMSNorm
    return lspec


def block_spec(lspec, config, impl: str, vp_stage: int | None, dense_lspec=None, first_dense: int = 0,
               gdn_lspec=None, linear_layers: tuple[int, ...] = ()):
    """The transformer block of one chunk: `lspec` for each of its layers, `dense_lspec` for those
    among the model's first `first_dense` (global index), `gdn_lspec` for the gated delta-net layers
    `linear_layers` (global indices); with the local spec, the final norm is megarl's
    sequence-parallel capable RMSNorm (megatron's default for a layer spec is torch's, which
    refuses sequence parallelism)."""
    te = impl in ("te", "transformer_engine")
    per_layer = bool(first_dense) or gdn_lspec is not None
    if te and not per_layer:
        return lspec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage) if per_layer else 0
    linear = set(linear_layers)
    specs = [gdn_lspec if offset + i in linear else dense_lspec if offset + i < first_dense else lspec
             for i in range(n)]
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    from megarl.models.norm import RMSNorm

    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def _mask_padded_vocab_hook(vocab_size: int, padded: int):
    """Forward hook for the output layer: padded logit columns -> PADDED_VOCAB_LOGIT."""

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        if width == padded:  # gathered (or tp == 1)
            start = 0
        else:  # vocab-parallel shard of this TP rank
            from megatron.core import parallel_state as ps

            start = ps.get_tensor_model_parallel_rank() * width
        n_real = max(0, min(width, vocab_size - start))
        if n_real == width:
            return output
        col = torch.arange(width, device=logits.device) >= n_real
        return logits.masked_fill(col, PADDED_VOCAB_LOGIT), bias

    return hook


def build_model(hf_config: Any, *, dtype: torch.dtype | str = torch.float32, impl: str = "local",
                value_head: bool = False, make_vocab_size_divisible_by: int = 128,
                padded_vocab: int | None = None, mask_padded_vocab: bool = True,
                config_overrides: dict | None = None, seed: int | None = None) -> list:
    """Builds this rank's GPTModel chunk(s) (one per virtual pipeline stage) for an HF config.

    value_head=True builds a critic: the output layer is a replicated hidden->1 linear
    (`megarl.models.value_head.ValueHead`) and the model returns values [b, s, 1].
    padded_vocab overrides the padded vocabulary size (used to reload checkpoints).
    Weights are randomly initialised; load them with `megarl.weights.load_hf_weights` or
    `megarl.weights.load_megatron_checkpoint`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    spec = arch_spec(hf_config)
    dtype = parse_dtype(dtype)
    tp = ps.get_tensor_model_parallel_world_size()
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by)
    if vocab % tp or vocab < spec.vocab_size:
        raise ValueError(f"padded vocab size {vocab} must be >= {spec.vocab_size} and divisible by tp={tp}")
    tied = spec.tie_word_embeddings and not value_head
    config = transformer_config(spec, dtype=dtype, overrides=config_overrides)
    lspec = layer_spec(spec, impl)
    dense_lspec = layer_spec(spec, impl, dense=True) if spec.moe_first_dense else None
    gdn_lspec = gdn_layer_spec(spec, impl) if spec.gdn is not None else None
    linear_layers = spec.gdn.linear_layers if spec.gdn is not None else ()
    # a vision-language config keeps the LM's RoPE settings in text_config; multi-latent attention
    # has its own rotary module per layer (megarl.models.mla)
    inv_freq = None if spec.mla is not None else hf_inv_freq(
        hf_config.text_config if spec.vision is not None else hf_config, int(spec.head_dim * spec.rotary_percent))
    vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vp_size or 1):
        vp = vp_stage if vp_size else None
        kwargs = dict(
            config=config, vocab_size=vocab,
            transformer_layer_spec=block_spec(lspec, config, impl, vp, dense_lspec, spec.moe_first_dense,
                                              gdn_lspec, linear_layers),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=tied, position_embedding_type="rope",
            rotary_base=spec.rope_theta, rotary_percent=spec.rotary_percent, vp_stage=vp,
        )
        if value_head and spec.vision is not None:  # a vision-language critic
            from megarl.models.value_head import value_model_class
            from megarl.models.vision import model_class

            model = value_model_class(model_class(spec))(seed=seed, arch_spec=spec, **kwargs)
        elif value_head:
            from megarl.models.value_head import ValueModel

            model = ValueModel(seed=seed, **kwargs)
        elif spec.vision is not None:  # GPTModel + vision tower on the first stage, M-RoPE
            from megarl.models.vision import model_class

            model = model_class(spec)(arch_spec=spec, **kwargs)
        else:
            model = GPTModel(**kwargs)
        if inv_freq is not None:
            model.rotary_pos_emb.inv_freq = inv_freq.clone().to(model.rotary_pos_emb.inv_freq.device)
        model.hf_vocab_size = spec.vocab_size  # true vocabulary (padding stripped on export)
        model.arch_spec = spec
        if model.post_process and not value_head and mask_padded_vocab and vocab > spec.vocab_size:
            model.output_layer.register_forward_hook(_mask_padded_vocab_hook(spec.vocab_size, vocab))
        chunks.append(model.to(device()))
    return chunks


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model
