"""A compact decoder-only transformer for the builtin rollout engine.

Covers the dense HF families Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and
Llama 3 (optional llama3 rope scaling, tied or untied embeddings), and the MoE families
Qwen3-MoE and Qwen2-MoE (`megarl.rollout.torch_moe`); the vision-language Qwen2.5-VL builds on it
(`megarl.rollout.torch_vlm`). Module attribute names mirror
the HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`, ...), so `state_dict()` keys
are HF names and loading a weight stream is a name lookup.

Numerics follow transformers 4.57 and 5.19 (`models/{qwen2,qwen3,llama}/modeling_*.py`,
`modeling_rope_utils.py`): RMSNorm in fp32 then cast back before the weight multiply, rotary
cos/sin computed in fp32 and cast to the activation dtype, `rotate_half` RoPE layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.rope import SUPPORTED_ROPE_TYPES, rope_params, scaled_inv_freq, scaling_type
from megarl.registry import Registry


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of one decoder (everything the forward pass needs from config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # `megarl.models.rope.rope_params` scaling: None or {"rope_type": ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    num_experts: int = 0  # > 0: every MLP is a `torch_moe.SparseMoE`
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    mrope_section: tuple[int, ...] = ()  # qwen2_5_vl: M-RoPE chunks of head_dim / 2 (`torch_vlm`)
    vision: Any = None  # qwen2_5_vl: `megarl.models.vision.spec.VisionSpec` of the vision tower
    # DeepSeek-V3 / Kimi-K2 / GLM-4.5 (`megarl.rollout.torch_mla`): the family's own layers, RoPE
    # and cache layout (`layer`, `rope`, `cache_shapes`, `cache_detail`); None for the rest
    variant: Any = None


def _get(cfg: dict, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _common_args(cfg: dict) -> dict:
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"config.json: missing field {key!r} (model_type={cfg.get('model_type')})")
    if _get(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError("config.json: sliding-window attention is not supported by the builtin engine")
    n_heads = cfg["num_attention_heads"]
    rope = rope_params(cfg)
    return dict(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", n_heads),
        head_dim=_get(cfg, "head_dim", cfg["hidden_size"] // n_heads),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
    )


# HF model_type -> fn(config.json dict) -> ModelArgs; torch_vlm registers the vision-language ones
MODEL_FAMILIES = Registry("builtin-engine model family")


@MODEL_FAMILIES.register("qwen2")
def _qwen2_args(cfg: dict) -> ModelArgs:
    return ModelArgs(**_common_args(cfg), qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


@MODEL_FAMILIES.register("qwen3")
def _qwen3_args(cfg: dict) -> ModelArgs:
    bias = bool(_get(cfg, "attention_bias", False))
    return ModelArgs(**_common_args(cfg), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


@MODEL_FAMILIES.register("llama")
def _llama_args(cfg: dict) -> ModelArgs:
    bias = bool(_get(cfg, "attention_bias", False))
    return ModelArgs(**_common_args(cfg), qkv_bias=bias, o_bias=bias,
                     mlp_bias=bool(_get(cfg, "mlp_bias", False)), qk_norm=False)


def _moe_args(cfg: dict, dense: ModelArgs, shared: int) -> ModelArgs:
    import dataclasses

    if _get(cfg, "decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError("config.json: MoE models with dense layers (decoder_sparse_step / mlp_only_layers) "
                         "are not supported by the builtin engine")
    return dataclasses.replace(
        dense, num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts")),
        moe_topk=int(cfg["num_experts_per_tok"]), moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)), shared_expert_intermediate_size=shared)


@MODEL_FAMILIES.register("qwen3_moe")
def _qwen3_moe_args(cfg: dict) -> ModelArgs:
    return _moe_args(cfg, _qwen3_args(cfg), 0)


@MODEL_FAMILIES.register("qwen2_moe")
def _qwen2_moe_args(cfg: dict) -> ModelArgs:
    bias = bool(_get(cfg, "qkv_bias", True))
    dense = ModelArgs(**_common_args(cfg), qkv_bias=bias, o_bias=False, mlp_bias=False, qk_norm=False)
    return _moe_args(cfg, dense, int(_get(cfg, "shared_expert_intermediate_size", 0)))


def model_args_from_hf_config(config: Any) -> ModelArgs:
    """HF config (dict, `PretrainedConfig` or `ModelArgs`) -> `ModelArgs`."""
    if isinstance(config, ModelArgs):
        return config
    cfg = config if isinstance(config, dict) else config.to_dict()
    model_type = cfg.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported by the builtin "
                         f"engine (supported: {sorted(MODEL_FAMILIES)})")
    return MODEL_FAMILIES[model_type](cfg)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies and the cos/sin scale, as `ROPE_INIT_FUNCTIONS` computes them.

    default: inv_freq_i = 1 / theta^(2i/d), i = 0..d/2-1.
    linear:  inv_freq / factor.
    llama3:  wavelen = 2π / inv_freq; wavelen > L/low_ff -> inv_freq / factor; wavelen < L/high_ff
             -> unchanged; otherwise (1 - s) * inv_freq / factor + s * inv_freq with
             s = (L / wavelen - low_ff) / (high_ff - low_ff), L = original_max_position_embeddings.
    The scale (`attention_factor`) is 1 for all three. A family variant computes its own
    (`torch_mla`: YaRN, partial RoPE).
    """
    if args.variant is not None:
        return args.variant.rope(args)
    rope_type = scaling_type(args.rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported by the builtin "
                         f"engine (supported: {sorted(SUPPORTED_ROPE_TYPES)})")
    return scaled_inv_freq(args.rope_theta, args.rope_scaling, args.head_dim), 1.0


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim]; angle = position * inv_freq (fp32)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), normalised in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


GIB = 1024**3


def cache_shapes(args: ModelArgs, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's key and value buffer shapes, [batch, kv_heads, max_len, head_dim] each (a family
    variant's own: multi-latent attention caches its latent, `torch_mla`)."""
    if args.variant is not None:
        return args.variant.cache_shapes(args, batch, max_len)
    shape = (batch, args.num_kv_heads, max_len, args.head_dim)
    return shape, shape


def kv_cache_bytes(args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache: layers * (key + value buffer elements) * element size, i.e.
    layers * 2 (K, V) * batch * max_len * kv_heads * head_dim * element size for standard attention."""
    element = torch.empty(0, dtype=dtype).element_size()
    if hasattr(args.variant, "cache_bytes"):  # layers of several kinds (torch_hybrid)
        return args.variant.cache_bytes(args, batch, max_len, element)
    k, v = cache_shapes(args, batch, max_len)
    return args.num_layers * (math.prod(k) + math.prod(v)) * element


class KVCacheBudgetError(ValueError):
    """A generate call whose KV cache would exceed the engine's budget (rollout.kv_cache_gb)."""


def check_kv_cache_budget(args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype,
                          budget_gib: float | None) -> int:
    """The KV cache bytes of `batch` rows of `max_len` slots; raises KVCacheBudgetError above
    `budget_gib` GiB (None: no limit), before anything is allocated."""
    need = kv_cache_bytes(args, batch, max_len, dtype)
    if budget_gib is not None and need > budget_gib * GIB:
        raise KVCacheBudgetError(
            f"rollout KV cache needs {need / GIB:.4g} GiB > rollout.kv_cache_gb={budget_gib:g} GiB "
            f"({args.num_layers} layers x {_cache_detail(args, batch, max_len)} x "
            f"{torch.empty(0, dtype=dtype).element_size()} bytes); lower rollout.max_new_tokens "
            "or data.max_prompt_len, generate fewer sequences per engine (rollout.prompts_per_step, "
            "rollout.gen_batch_prompts, rollout.n_samples_per_prompt, or more ranks), or raise rollout.kv_cache_gb")
    return need


def _cache_detail(args: ModelArgs, batch: int, max_len: int) -> str:
    if args.variant is not None:
        return args.variant.cache_detail(args, batch, max_len)
    return f"2 x {batch} sequences x {max_len} tokens x {args.num_kv_heads} KV heads x {args.head_dim}"


class KVCache:
    """Per-layer key/value buffers [B, n_kv_heads, max_len, head_dim], preallocated once (a family
    variant's own shapes, `cache_shapes`; dim 2 is always the token slot).

    Rows are sequences; slots are aligned across rows (prompts are left-padded). Row selection and
    repetition replace one layer at a time, so they need one layer's buffers on top of the cache,
    not a second cache.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values

    @classmethod
    def allocate(cls, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> "KVCache":
        if hasattr(args.variant, "allocate_cache"):  # a family's own cache (torch_hybrid: recurrent states)
            return args.variant.allocate_cache(args, batch, max_len, dtype, device)
        k, v = cache_shapes(args, batch, max_len)
        return cls([torch.empty(k, dtype=dtype, device=device) for _ in range(args.num_layers)],
                   [torch.empty(v, dtype=dtype, device=device) for _ in range(args.num_layers)])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def write_rows(self, rows: torch.Tensor, part: "KVCache", width: int) -> None:
        """Copies a prefill's cache `part` (its rows of L slots) into rows `rows`, slots
        [width - L, width), zeroing the slots left of them (masked; 0 * NaN garbage would be NaN)."""
        for full, new in zip((*self.keys, *self.values), (*part.keys, *part.values)):
            full[rows, :, width - new.shape[2]:width] = new
            full[rows, :, :width - new.shape[2]] = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        for i in range(len(self.keys)):
            self.keys[i] = self.keys[i].index_select(0, rows)
            self.values[i] = self.values[i].index_select(0, rows)

    def repeat_rows(self, n: int) -> None:
        for i in range(len(self.keys)):
            self.keys[i] = self.keys[i].repeat_interleave(n, dim=0)
            self.values[i] = self.values[i].repeat_interleave(n, dim=0)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE on queries and keys [b, heads, t, head_dim] (a subclass may rotate part of a head)."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        a = self.args
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(bsz, t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(bsz, t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rotate(q, k, cos, sin)
        k_cache[:, :, start:start + t] = k
        v_cache[:, :, start:start + t] = v
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :start + t], v_cache[:, :, :start + t], attn_mask=mask,
            scale=a.head_dim ** -0.5, enable_gqa=a.num_heads != a.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, a.num_heads * a.head_dim))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.mixer_name = "self_attn"
        norm = getattr(args.variant, "norm", RMSNorm)  # torch_hybrid: zero-centred
        if args.variant is not None:  # the family's token mixer and MLP of layer `index` (torch_mla, torch_hybrid)
            mixer, self.mlp = args.variant.layer(args, index)
            self.mixer_name = getattr(args.variant, "mixer_name", lambda i: "self_attn")(index)  # HF's name
            setattr(self, self.mixer_name, mixer)
        elif args.num_experts:
            from megarl.rollout.torch_moe import SparseMoE

            self.self_attn = Attention(args)
            self.mlp = SparseMoE(args.hidden_size, args.num_experts, args.moe_topk, args.moe_intermediate_size,
                                 args.norm_topk_prob, args.shared_expert_intermediate_size)
        else:
            self.self_attn, self.mlp = Attention(args), MLP(args)
        self.input_layernorm = norm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = norm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = getattr(args.variant, "norm", RMSNorm)(args.hidden_size, args.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM whose `state_dict()` keys are the HF checkpoint names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = _Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        inv_freq, self.rope_scale = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def empty(cls, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> "DecoderLM":
        """Allocates parameters without initialising them (weights come from a stream)."""
        with torch.device("meta"):
            model = cls(args)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        model.inv_freq = rope_inv_freq(args)[0].to(device)  # to_empty left it uninitialised
        return model.eval().requires_grad_(False)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (fp32) of the last position.

        tokens, positions: [B, T]; written to cache slots [start, start + T).
        mask: bool [B, 1, T, start + T], True where a query may attend to a key.
        """
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale, x.dtype)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.keys, cache.values):
            x = layer(x, cos, sin, k_cache, v_cache, start, mask)
        return self.lm_head(self.model.norm(x[:, -1])).float()
