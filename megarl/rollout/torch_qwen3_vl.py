"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`) for the builtin rollout engine, and the
vision side of Qwen3.5 (`qwen3_5`, `qwen3_5_moe`: its layers from `torch_hybrid`, no DeepStack).

`Qwen3VisionLM` is `torch_vlm.VisionLM` (prompt contexts, images and videos, rope deltas, prefill
inputs) with Qwen3-VL's parts, following transformers 5.19 `models/qwen3_vl/modeling_qwen3_vl.py`
and `models/qwen3_vl_moe/modeling_qwen3_vl_moe.py`:

- tower (`Qwen3VisionTower`): Conv3d patch embedding with bias, plus the learned position table
  resampled bilinearly to each image's grid (`qwen3_vl_geometry.position_table_taps`); LayerNorm
  blocks with fp32 2D RoPE and non-causal attention within each frame (`torch_vlm.VisionAttention`),
  a non-gated MLP; the merger (LayerNorm, m^2 patches concatenated, Linear + GELU + Linear) and one
  DeepStack merger per `deepstack_visual_indexes` entry (LayerNorm after the concatenation) on that
  block's output;
- LM: Qwen3 (q/k RMSNorm) with interleaved M-RoPE (frequency i rotates by position axis
  `interleaved_mrope_axes(section)[i]`); in prefill, DeepStack feature k is added to the hidden
  states of the image / video tokens after decoder layer k (zero addends elsewhere). Decode steps
  give all three axes one position (n + rope delta), where interleaving changes nothing;
- Qwen3-VL-MoE: every MLP a top-k softmax MoE, top-k weights always renormalised (HF's router
  ignores `norm_topk_prob`), experts held as the checkpoint's two fused tensors in the released
  layout (`FusedExperts`: gate_up_proj [E, H, 2I], down_proj [E, I, H]; a transformers-5 file is
  read transposed by `megarl.weights.HFCheckpoint`); routing recorded like `torch_moe.SparseMoE`'s.

Module names after `torch_vlm.hf_param_name` are the checkpoint's (`model.language_model.x` ->
`model.x`, `model.visual.x` -> `visual.x`), so a weight stream loads by name.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.vision import geometry
from megarl.models.vision.qwen3_vl_geometry import (
    interleaved_mrope_angles, interleaved_mrope_axes, position_table_taps)
from megarl.models.vision.qwen3_vl_spec import Qwen3VisionSpec, qwen3_vision_spec
from megarl.rollout.torch_model import (
    MODEL_FAMILIES, DecoderLM, KVCache, ModelArgs, _common_args, _get, _moe_args, rope_cos_sin)
from megarl.rollout.torch_moe import SparseMoE
from megarl.rollout.torch_vlm import VisionAttention, VisionLM

# HF ACT2FN names -> the same functions
_ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def config_vision_spec(cfg: dict, model_type: str) -> Qwen3VisionSpec:
    """The Qwen3-VL-style tower of config.json's `vision_config` (Qwen3-VL(-MoE), Qwen3.5(-MoE));
    every problem a ValueError naming config.json."""
    hf_like = SimpleNamespace(model_type=model_type, image_token_id=cfg.get("image_token_id"),
                              video_token_id=cfg.get("video_token_id"), vision_config=SimpleNamespace(**cfg["vision_config"]))
    try:
        return qwen3_vision_spec(hf_like)
    except (AttributeError, TypeError) as e:
        raise ValueError(f"config.json: {model_type} vision_config is incomplete ({e})") from e
    except ValueError as e:  # UnsupportedModelError
        raise ValueError(f"config.json: {e}") from e


def _qwen3_vl_args(cfg: dict) -> ModelArgs:
    """`ModelArgs` of a qwen3_vl / qwen3_vl_moe config.json (the LM from `text_config`)."""
    model_type = cfg["model_type"]
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or not isinstance(cfg.get("text_config"), dict):
        raise ValueError(f"config.json: model_type={model_type!r} needs a 'vision_config' and a 'text_config'")
    text = dict(cfg["text_config"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(x) for x in rope.pop("mrope_section", None) or ())
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json: {model_type} rope type {rope.get('rope_type')!r} is not supported by "
                         "the builtin engine (only default interleaved M-RoPE)")
    text.update(model_type=model_type, rope_scaling=None,
                rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 5e6)},
                tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", _get(text, "tie_word_embeddings", False))))
    bias = bool(_get(text, "attention_bias", False))
    args = ModelArgs(**_common_args(text), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
    if model_type == "qwen3_vl_moe":
        args = dataclasses.replace(_moe_args(text, args, 0), norm_topk_prob=True)
    if len(section) != 3 or sum(section) != args.head_dim // 2:
        raise ValueError(f"config.json: mrope_section={list(section)} must be 3 sections summing to "
                         f"head_dim/2 = {args.head_dim // 2}")
    vision = config_vision_spec(cfg, model_type)
    if vision.out_hidden_size != args.hidden_size:
        raise ValueError(f"config.json: vision out_hidden_size={vision.out_hidden_size} != text hidden_size="
                         f"{args.hidden_size}")
    if len(vision.deepstack_visual_indexes) > args.num_layers:
        raise ValueError(f"config.json: {len(vision.deepstack_visual_indexes)} DeepStack features for "
                         f"{args.num_layers} LM layers")
    return dataclasses.replace(args, mrope_section=section, vision=vision)


MODEL_FAMILIES.register("qwen3_vl")(_qwen3_vl_args)
MODEL_FAMILIES.register("qwen3_vl_moe")(_qwen3_vl_args)


# ---------------------------------------------------------------------------- MoE with fused experts


class FusedExperts(nn.Module):
    """A layer's experts as HF's two fused tensors (released layout); `experts[g](x)` is expert g:
    down(silu(gate) * up) with [gate, up] = x @ gate_up_proj[g]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def __getitem__(self, g: int):
        def expert(x: torch.Tensor) -> torch.Tensor:
            gate, up = (x @ self.gate_up_proj[g]).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ self.down_proj[g]

        return expert


class FusedSparseMoE(SparseMoE):
    """`SparseMoE` routing (top-k renormalised) over `FusedExperts`."""

    def __init__(self, hidden: int, num_experts: int, topk: int, expert_ffn: int):
        nn.Module.__init__(self)
        self.topk, self.norm_topk_prob = topk, True
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, expert_ffn)
        self.routing_log: list[torch.Tensor] | None = None


# ---------------------------------------------------------------------------- vision tower


class _Block(nn.Module):
    def __init__(self, v: Qwen3VisionSpec):
        super().__init__()
        self.norm1 = nn.LayerNorm(v.hidden_size, eps=v.norm_eps)
        self.norm2 = nn.LayerNorm(v.hidden_size, eps=v.norm_eps)
        self.attn = VisionAttention(v)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(v.hidden_size, v.ffn_hidden_size)
        self.mlp.linear_fc2 = nn.Linear(v.ffn_hidden_size, v.hidden_size)
        self.act = _ACTIVATIONS[v.hidden_act]

    def forward(self, x, cu, cos, sin):
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class _Merger(nn.Module):
    """LayerNorm over c (before) or m^2 c (after concatenating each m x m block), then
    Linear + GELU + Linear."""

    def __init__(self, v: Qwen3VisionSpec, postshuffle: bool):
        super().__init__()
        self.size, self.postshuffle = v.merged_size, postshuffle
        self.norm = nn.LayerNorm(v.merged_size if postshuffle else v.hidden_size, eps=v.norm_eps)
        self.linear_fc1 = nn.Linear(v.merged_size, v.merged_size)
        self.linear_fc2 = nn.Linear(v.merged_size, v.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.size) if self.postshuffle else x).view(-1, self.size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """HF's `model.visual`: pixel_values [N, C*tp*p*p] + grid_thw [n, 3] -> (embeddings
    [N / m^2, out_hidden_size], DeepStack features in `deepstack_visual_indexes` order)."""

    def __init__(self, v: Qwen3VisionSpec):
        super().__init__()
        self.v = v
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=k, stride=k, bias=True)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        self.blocks = nn.ModuleList(_Block(v) for _ in range(v.depth))
        self.merger = _Merger(v, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(v, postshuffle=True) for _ in v.deepstack_visual_indexes)
        self.register_buffer("inv_freq", geometry.vision_rope_inv_freq(v.head_dim, v.rope_theta), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        v, m = self.v, self.v.spatial_merge_size
        w = self.patch_embed.proj.weight
        x = pixel_values.to(w.dtype).view(-1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed.proj(x).view(-1, v.hidden_size)
        dev = x.device
        taps, weights = position_table_taps(grid_thw, v.position_grid_side, m)
        pos = (self.pos_embed(taps.to(dev)) * weights.to(dev)[:, :, None]).sum(1)  # float32 weights, as HF
        x = x + pos.to(x.dtype)
        angles = geometry.vision_rope_angles(geometry.patch_hw_positions(grid_thw, m).to(dev), self.inv_freq.float())
        cos, sin = angles.cos(), angles.sin()
        cu = geometry.patch_cu_seqlens(grid_thw)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu, cos, sin)
            if i in v.deepstack_visual_indexes:
                features.append(self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), features


# ---------------------------------------------------------------------------- the VLM


class Qwen3VisionLM(VisionLM):
    """Qwen3-VL / Qwen3-VL-MoE: `DecoderLM` + `visual` (`Qwen3VisionTower`), interleaved M-RoPE,
    DeepStack (module doc)."""

    def __init__(self, args: ModelArgs):
        DecoderLM.__init__(self, args)
        self.visual = Qwen3VisionTower(args.vision)
        if args.num_experts and args.variant is None:  # Qwen3.5-MoE (a variant): per-expert tensors
            for layer in self.model.layers:
                layer.mlp = FusedSparseMoE(args.hidden_size, args.num_experts, args.moe_topk,
                                           args.moe_intermediate_size)
        axes = interleaved_mrope_axes(args.mrope_section, self.inv_freq.numel())  # Qwen3.5: the rotated quarter
        self.register_buffer("mrope_axes", axes, persistent=False)

    @classmethod
    def empty(cls, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> "Qwen3VisionLM":
        model = super().empty(args, dtype, device)
        model.mrope_axes = interleaved_mrope_axes(args.mrope_section, model.inv_freq.numel()).to(device)
        return model

    def visual_embeddings(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.visual(pixels, grid)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor, embeds: torch.Tensor | None = None,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """As `VisionLM.forward`; `deepstack` [levels, B, T, hidden] is added to the output of
        decoder layers 0..levels-1 (prefill)."""
        x = self.model.embed_tokens(tokens) if embeds is None else embeds
        if positions.dim() == 2:
            cos, sin = rope_cos_sin(positions, self.inv_freq, 1.0, x.dtype)
        else:
            angles = interleaved_mrope_angles(positions, self.inv_freq, self.mrope_axes)
            cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
        for k, (layer, k_cache, v_cache) in enumerate(zip(self.model.layers, cache.keys, cache.values)):
            x = layer(x, cos, sin, k_cache, v_cache, start, mask)
            if deepstack is not None and k < deepstack.shape[0]:
                x = x + deepstack[k]
        return self.lm_head(self.model.norm(x[:, -1])).float()


def vision_lm_class(args: ModelArgs) -> type[VisionLM]:
    """The builtin engine's model class for a vision-language `ModelArgs`."""
    return Qwen3VisionLM if isinstance(args.vision, Qwen3VisionSpec) else VisionLM


__all__ = ["FusedExperts", "FusedSparseMoE", "Qwen3VisionLM", "Qwen3VisionTower", "vision_lm_class"]
