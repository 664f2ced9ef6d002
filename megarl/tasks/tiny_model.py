"""A byte-level tokenizer and a tiny random Qwen2 / Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 / GLM-4.5
model, built offline.

Tokenizer: BPE with no merges over the 256 GPT-2 byte symbols, so every byte (every ASCII
character) is one token and any UTF-8 text round-trips exactly (`decode(encode(s)) == s`).
Reloaded from a saved directory with `AutoTokenizer` (as megarl and SGLang load it), transformers
5.x builds a `Qwen2Tokenizer` (forced for model_type "qwen2"), which NFC-normalises the text
first: the ids are the same on NFC text (all ASCII, so every quickstart text), but a non-NFC
string (e + U+0301 combining acute) comes back composed (é).
For the MoE model types it builds the generic `TokenizersBackend` (the same ids, no NFC step).
Ids 0..255 are the bytes, followed by the special tokens ``<|endoftext|>`` (EOS and pad),
``<|im_start|>`` and ``<|im_end|>``. A Qwen-style chat template is attached.

Model: `transformers.Qwen2Config` (family "qwen2"), `Qwen3MoeConfig` ("qwen3_moe": q/k norms,
top-k probabilities renormalised) or `Qwen2MoeConfig` ("qwen2_moe": q/k/v bias, a shared expert
of `moe_intermediate` with its sigmoid gate, no renormalisation) from scratch. The MoE families
replace every dense MLP by `num_experts` experts of `moe_intermediate`, `moe_topk` per token, so
with moe_intermediate = intermediate / moe_topk a token costs the dense model's MLP FLOPs.
`DeepseekV3Config` ("deepseek_v3": multi-latent attention) and `Glm4MoeConfig` ("glm4_moe") route
by sigmoid scores with a selection bias and keep a dense first layer and a shared expert
(`_sigmoid_moe_config`). `Qwen3NextConfig` ("qwen3_next") has gated delta-net layers and one gated
attention layer (`_qwen3_next_config`).
`vocab_size` is the tokenizer size rounded up to `vocab_multiple` (like real Qwen checkpoints,
whose embedding has spare rows), which keeps vocab-parallel splits even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with one token per byte plus the special tokens above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]), clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(symbol: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(symbol)
    if code in printable:
        return code
    rest = [b for b in range(256) if b not in printable]
    return rest[code - 256]


@dataclass
class TinyModelSpec:
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    vocab_multiple: int = 64
    initializer_range: float = 0.02
    seed: int = 0
    family: str = "qwen2"  # one of TINY_FAMILIES
    num_experts: int = 0  # MoE families only (>= 2), as moe_topk and moe_intermediate
    moe_topk: int = 0
    moe_intermediate: int = 0


TINY_FAMILIES = ("qwen2", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "qwen3_next")


def tiny_config(tokenizer: Any, spec: TinyModelSpec) -> Any:
    """The HF config of the tiny model of `spec.family` sized for `tokenizer`."""
    import transformers

    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"tiny model: hidden {spec.hidden} must divide by heads {spec.heads}, "
                         f"and heads by kv_heads {spec.kv_heads}")
    if spec.family not in TINY_FAMILIES:
        raise ValueError(f"tiny model: family {spec.family!r} is not one of {TINY_FAMILIES}")
    vocab = math.ceil(len(tokenizer) / spec.vocab_multiple) * spec.vocab_multiple
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range, rms_norm_eps=1e-6, use_sliding_window=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if spec.family == "qwen2":
        return transformers.Qwen2Config(**common)
    if not (2 <= spec.num_experts and 0 < spec.moe_topk <= spec.num_experts and spec.moe_intermediate > 0):
        raise ValueError(f"tiny {spec.family}: needs num_experts >= 2 (got {spec.num_experts}), 0 < moe_topk <= "
                         f"num_experts (got {spec.moe_topk}) and moe_intermediate > 0 (got {spec.moe_intermediate})")
    moe = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk,
               moe_intermediate_size=spec.moe_intermediate, decoder_sparse_step=1, mlp_only_layers=[],
               output_router_logits=False, router_aux_loss_coef=0.0)
    if spec.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe, head_dim=spec.hidden // spec.heads,
                                           norm_topk_prob=True)
    if spec.family in ("deepseek_v3", "glm4_moe"):
        return _sigmoid_moe_config(spec, common)
    if spec.family == "qwen3_next":
        return _qwen3_next_config(spec, common, moe)
    return transformers.Qwen2MoeConfig(**common, **moe, norm_topk_prob=False,
                                       shared_expert_intermediate_size=spec.moe_intermediate)


def _sigmoid_moe_config(spec: TinyModelSpec, common: dict) -> Any:
    """DeepSeek-V3 / GLM-4.5 (megarl.models.deepseek): the first layer dense, one shared expert of
    `moe_intermediate`, sigmoid routing with a (zero) selection bias, experts in 2 groups of which
    each token's top-2 experts come from 1 (with top-2 and an even expert count), weights scaled
    by 2.5 (DeepSeek-V3's routed_scaling_factor); no multi-token-prediction layer. deepseek_v3:
    multi-latent attention with head_dim = hidden / heads split as nope = head_dim, rope =
    head_dim / 2, v = head_dim, and q / kv latents of hidden / 2. glm4_moe: q/k/v biases,
    q/k norms, RoPE on half of each head."""
    import transformers

    common = {k: v for k, v in common.items() if k not in ("use_sliding_window", "rope_theta")}
    grouped = spec.moe_topk == 2 and spec.num_experts % 2 == 0
    moe = dict(n_routed_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk,
               moe_intermediate_size=spec.moe_intermediate, n_shared_experts=1, first_k_dense_replace=1,
               n_group=2 if grouped else 1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    d = spec.hidden // spec.heads
    if spec.family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": spec.heads}, **moe, q_lora_rank=spec.hidden // 2,
            kv_lora_rank=spec.hidden // 2, qk_nope_head_dim=d, qk_rope_head_dim=d // 2, v_head_dim=d)
    return transformers.Glm4MoeConfig(**common, **moe, head_dim=d, attention_bias=True, use_qk_norm=True,
                                      partial_rotary_factor=0.5)


def _qwen3_next_config(spec: TinyModelSpec, common: dict, moe: dict) -> Any:
    """Qwen3-Next (megarl.models.hybrid): every layer but the last a gated delta-net (2 key / 4 value
    heads of hidden / 4), the last gated attention with RoPE on a quarter of each head; every MLP
    the MoE plus a gated shared expert of `moe_intermediate`."""
    import transformers

    common = {k: v for k, v in common.items() if k not in ("use_sliding_window", "rope_theta")}
    d = spec.hidden // spec.heads
    return transformers.Qwen3NextConfig(
        **common, **moe, head_dim=d, norm_topk_prob=True, shared_expert_intermediate_size=spec.moe_intermediate,
        layer_types=["linear_attention"] * (spec.layers - 1) + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=spec.hidden // 4, linear_value_head_dim=spec.hidden // 4,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": 0.25})


def build_tiny_model(tokenizer: Any, spec: TinyModelSpec) -> Any:
    """A randomly initialised causal LM of `spec.family` (fp32) sized for `tokenizer`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(tokenizer, spec)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


build_tiny_qwen2 = build_tiny_model  # the name older tools use (family "qwen2" by default)


def save_tiny_model(out_dir: str | Path, spec: TinyModelSpec, model: Any = None, tokenizer: Any = None) -> Path:
    """Build (unless given) and save tokenizer + model (safetensors) + generation_config."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_byte_tokenizer()
    model = model if model is not None else build_tiny_model(tokenizer, spec)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
