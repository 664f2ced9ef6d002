"""Qwen2.5-VL (HF model_type `qwen2_5_vl`) for the builtin rollout engine: vision tower + merger and
the Qwen2 decoder with M-RoPE.

Module attribute names mirror the HF checkpoint names (`visual.patch_embed.proj.weight`,
`visual.blocks.0.attn.qkv.weight`, `visual.merger.mlp.0.weight`, `model.layers.0...`,
`lm_head.weight`), so a weight stream (`megarl.weights.stream_hf_weights` of megatron's
`Qwen2_5_VLModel`, or the safetensors files) loads by name. transformers-5 module names
(`model.language_model.*`, `model.visual.*`) are accepted too (`hf_param_name`).

Numerics follow transformers 5.19 `models/qwen2_5_vl/modeling_qwen2_5_vl.py`:
- tower: Conv3d patch embedding; patches reordered window by window (merge blocks of m^2 patches
  kept together, `megarl.models.vision.geometry.window_partition`); axial 2D RoPE applied in fp32;
  non-causal attention within each window (or each frame of each image in
  `fullatt_block_indexes`); RMSNorm + SwiGLU blocks with biases; merger RMSNorm, m^2 patches
  concatenated, Linear + GELU + Linear; the window order undone (one embedding per merge block);
- the image embeddings replace the embeddings of the image placeholder tokens, in order
  (HF's `masked_scatter`);
- videos: `pixel_values_videos` through the same tower (t > 1), written at the video placeholders;
  a context's image and video embeddings are kept in context order (`prepare_context`), with the
  DeepStack features of Qwen3-VL (`torch_qwen3_vl`, which builds on this module);
- M-RoPE: positions [3, B, T] (`megarl.models.vision.mrope.vision_position_ids`, HF's
  `get_rope_index`); frequency chunk c of `mrope_section` rotates by position axis c % 3. A
  context's rope delta is max(position) + 1 - len(context): a generated token at index n of the
  sequence gets position n + delta on all three axes (HF's `rope_deltas`), i.e. decode continues
  at the previous maximum + 1. Text-only contexts have delta 0 and positions (p, p, p), which is
  the 1-D RoPE of the text families.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.vision import geometry
from megarl.models.vision.mrope import vision_position_ids
from megarl.models.vision.spec import VisionSpec
from megarl.rollout.torch_model import (
    MLP, MODEL_FAMILIES, DecoderLM, KVCache, ModelArgs, RMSNorm, _common_args, _get, rope_cos_sin)
from megarl.rollout.types import PromptImages


@MODEL_FAMILIES.register("qwen2_5_vl")
def qwen2_5_vl_args(cfg: dict) -> ModelArgs:
    """`ModelArgs` of a qwen2_5_vl config.json: the LM from `text_config` (transformers 5) or the top
    level (transformers 4), `mrope_section` from its rope dict, `vision` from `vision_config`."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError("config.json: model_type='qwen2_5_vl' needs a 'vision_config'")
    text = dict(cfg.get("text_config") or {k: val for k, val in cfg.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(x) for x in rope.pop("mrope_section", None) or ())
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ValueError(f"config.json: qwen2_5_vl rope type {rope.get('rope_type', rope.get('type'))!r} "
                         "is not supported by the builtin engine (only default M-RoPE)")
    theta = rope.get("rope_theta", text.get("rope_theta", 1e6))
    text.update(model_type="qwen2_5_vl", rope_scaling=None,
                rope_parameters={"rope_type": "default", "rope_theta": theta},
                tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", _get(text, "tie_word_embeddings", False))))
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]  # HF's text attention ignores head_dim
    common = _common_args(text)
    if len(section) != 3 or sum(section) != common["head_dim"] // 2:
        raise ValueError(f"config.json: mrope_section={list(section)} must be 3 sections summing to "
                         f"head_dim/2 = {common['head_dim'] // 2}")
    if _get(v, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: vision hidden_act={v['hidden_act']!r} is not supported (only 'silu')")
    vrope = v.get("rope_parameters") or {}
    if vrope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json: vision rope_type={vrope.get('rope_type')!r} is not supported")
    hidden = int(v.get("hidden_size", v.get("embed_dim")))
    vision = VisionSpec(
        depth=int(v["depth"]), hidden_size=hidden, ffn_hidden_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]), head_dim=hidden // int(v["num_heads"]), in_channels=int(_get(v, "in_channels", _get(v, "in_chans", 3))),
        patch_size=int(v["patch_size"]), temporal_patch_size=int(_get(v, "temporal_patch_size", 2)),
        spatial_merge_size=int(_get(v, "spatial_merge_size", 2)), window_size=int(v["window_size"]),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes") or ()),
        out_hidden_size=int(v["out_hidden_size"]), rope_theta=float(vrope.get("rope_theta", 10000.0)), norm_eps=1e-6,
        image_token_id=int(cfg.get("image_token_id", text.get("image_token_id"))),
        video_token_id=cfg.get("video_token_id", text.get("video_token_id")),
        tokens_per_second=int(_get(v, "tokens_per_second", 4)))
    if vision.out_hidden_size != common["hidden_size"]:
        raise ValueError(f"config.json: vision out_hidden_size={vision.out_hidden_size} != text hidden_size="
                         f"{common['hidden_size']}")
    return ModelArgs(**common, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                     mrope_section=section, vision=vision)


def hf_param_name(name: str) -> str:
    """Checkpoint name of a transformers-5 module name (`model.language_model.x` -> `model.x`,
    `model.visual.x` -> `visual.x`); other names unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


# ---------------------------------------------------------------------------- vision tower


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, v: VisionSpec):
        super().__init__()
        self.num_heads, self.scale = v.num_heads, v.head_dim ** -0.5
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size, bias=True)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        dtype = q.dtype
        cos, sin = cos[:, None].float(), sin[:, None].float()  # RoPE in fp32, as HF
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, d]
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=self.scale)
                for a, b in zip(cu[:-1], cu[1:]) if b > a]
        out = torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(n, -1)
        return self.proj(out)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionSpec):
        super().__init__()
        self.norm1 = RMSNorm(v.hidden_size, v.norm_eps)
        self.norm2 = RMSNorm(v.hidden_size, v.norm_eps)
        self.attn = VisionAttention(v)
        self.mlp = MLP(SimpleNamespace(hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size,
                                       mlp_bias=True))

    def forward(self, x, cu, cos, sin):
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: VisionSpec):
        super().__init__()
        self.ln_q = RMSNorm(v.hidden_size, v.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(v.merged_size, v.merged_size), nn.GELU(),
                                 nn.Linear(v.merged_size, v.out_hidden_size))
        self.merged_size = v.merged_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


class VisionTower(nn.Module):
    """HF's `visual`: pixel_values [N, C*tp*p*p] + grid_thw [n, 3] -> [N / m^2, out_hidden_size]."""

    def __init__(self, v: VisionSpec):
        super().__init__()
        self.v = v
        self.patch_embed = nn.Module()
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=k, stride=k, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = PatchMerger(v)
        self.register_buffer("inv_freq", geometry.vision_rope_inv_freq(v.head_dim, v.rope_theta), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        v, m = self.v, self.v.spatial_merge_size
        unit = m * m
        window_index, cu_window = geometry.window_partition(grid_thw, m, v.window_size, v.patch_size)
        cu_full = geometry.patch_cu_seqlens(grid_thw)
        w = self.patch_embed.proj.weight
        x = pixel_values.to(w.dtype).view(-1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed.proj(x).view(-1, v.hidden_size)
        n = x.shape[0]
        dev = x.device
        win = window_index.to(dev)
        x = x.reshape(n // unit, unit, -1)[win].reshape(n, -1)
        angles = geometry.vision_rope_angles(geometry.patch_hw_positions(grid_thw, m).to(dev), self.inv_freq.float())
        angles = angles.reshape(n // unit, unit, -1)[win].reshape(n, -1)
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in v.fullatt_block_indexes else cu_window, cos, sin)
        return self.merger(x)[torch.argsort(win)]


# ---------------------------------------------------------------------------- the VLM


@dataclass
class VisionContext:
    """One context prepared for prefill: M-RoPE positions [3, len], rope delta, the embeddings
    [visual tokens, hidden] of its image and video placeholder tokens in context order (None
    without any), and per DeepStack level the features of those tokens (Qwen3-VL; else empty)."""

    positions: torch.Tensor
    delta: int
    image_embeds: torch.Tensor | None
    deepstack: list[torch.Tensor] = field(default_factory=list)


_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


def as_prompt_images(images: Any, what: str) -> PromptImages | None:
    """None, a `PromptImages` or a mapping with pixel_values / image_grid_thw and / or
    pixel_values_videos / video_grid_thw (+ second_per_grid_ts) (HF's processor output for this
    prompt's images and videos) -> `PromptImages` (None stays None)."""
    if images is None or isinstance(images, PromptImages):
        return images
    if isinstance(images, Mapping):
        kinds = [keys for keys in (("pixel_values", "image_grid_thw"), _VIDEO_KEYS) if any(k in images for k in keys)]
        missing = [k for keys in kinds or [("pixel_values", "image_grid_thw")] for k in keys if k not in images]
        if missing:
            raise ValueError(f"{what}: images lack {missing} (pass HF image / video processor outputs)")
        get = lambda k: None if images.get(k) is None else torch.as_tensor(images[k])  # noqa: E731
        return PromptImages(get("pixel_values"), get("image_grid_thw"), get("pixel_values_videos"),
                            get("video_grid_thw"), get("second_per_grid_ts"))
    raise ValueError(f"{what}: images must be None, a PromptImages or a mapping with pixel_values and "
                     f"image_grid_thw, got {type(images).__name__}")


def check_images(args: ModelArgs, images: Any, n_prompts: int) -> list[PromptImages | None] | None:
    """Per-prompt images as `PromptImages` / None (a list of n_prompts); None for a text-only model
    (which refuses images)."""
    if args.vision is None:
        if images is not None and any(im is not None for im in images):
            raise ValueError(f"images were given but the {args.model_type} model has no vision tower")
        return None
    if images is None:
        return [None] * n_prompts
    if isinstance(images, (Mapping, PromptImages)) or len(images) != n_prompts:
        raise ValueError(f"images: expected a list with one entry (images or None) per prompt ({n_prompts}), "
                         f"got {type(images).__name__}")
    return [as_prompt_images(im, f"prompt {i}") for i, im in enumerate(images)]


def _check_pixels(v, kind: str, pixels: torch.Tensor, grid: torch.Tensor | None, n_tokens: int) -> torch.Tensor:
    """The grid [n, 3] of `kind` pixels that fit the vision spec and the context's n_tokens placeholders."""
    field = "image_grid_thw" if kind == "image" else "video_grid_thw"
    if grid is None:
        raise ValueError(f"{kind} pixels without {field}")
    grid = grid.reshape(-1, 3).long()
    if pixels.dim() != 2 or pixels.shape[1] != v.patch_dim:
        raise ValueError(f"{kind} pixel_values has shape {tuple(pixels.shape)}, expected [patches, {v.patch_dim}]")
    expected = int(grid.prod(-1).sum())
    if pixels.shape[0] != expected:
        raise ValueError(f"{kind} pixel_values has {pixels.shape[0]} patch rows, {field} describes {expected}")
    merged = sum(geometry.merged_token_counts(grid, v.spatial_merge_size))
    if merged != n_tokens:
        raise ValueError(f"{n_tokens} {kind} placeholder tokens but the {kind}s give {merged} embeddings")
    return grid


class VisionLM(DecoderLM):
    """Qwen2.5-VL: `DecoderLM` (HF names `model.*`, `lm_head`) + `visual` (module doc)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.visual = VisionTower(args.vision)

    @classmethod
    def empty(cls, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> "VisionLM":
        model = super().empty(args, dtype, device)
        v = args.vision
        model.visual.inv_freq = geometry.vision_rope_inv_freq(v.head_dim, v.rope_theta).to(device)
        return model

    def visual_embeddings(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(embeddings [tokens, hidden], DeepStack features: none in Qwen2.5-VL) of images or videos."""
        return self.visual(pixels, grid), []

    def visual_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """Where `tokens` hold image or video placeholders."""
        v = self.args.vision
        mask = tokens == v.image_token_id
        return mask if v.video_token_id is None else mask | (tokens == v.video_token_id)

    def prepare_context(self, ids: list[int], images: PromptImages | None) -> VisionContext:
        """Positions, rope delta and visual embeddings (the tower runs once here per modality) of
        one context."""
        v = self.args.vision
        t = torch.tensor(ids)[None]
        counts = {"image": int((t == v.image_token_id).sum()),
                  "video": int((t == v.video_token_id).sum()) if v.video_token_id is not None else 0}
        images = images or PromptImages(None, None)
        dev = self.lm_head.weight.device
        parts, grids = {}, {}
        for kind, pixels, grid in (("image", images.pixel_values, images.image_grid_thw),
                                   ("video", images.pixel_values_videos, images.video_grid_thw)):
            if pixels is None:
                if counts[kind]:
                    raise ValueError(f"{counts[kind]} {kind} placeholder tokens (id "
                                     f"{v.image_token_id if kind == 'image' else v.video_token_id}) but no {kind}s")
                continue
            grids[kind] = _check_pixels(v, kind, pixels, grid, counts[kind])
            if counts[kind]:
                parts[kind] = self.visual_embeddings(pixels.to(dev), grids[kind])
        pos, delta = vision_position_ids(t, v, grids.get("image"), grids.get("video"), images.second_per_grid_ts)
        if not parts:
            return VisionContext(pos[:, 0], int(delta), None)
        visual = t[0][self.visual_mask(t[0])]
        is_video = (visual == v.video_token_id) if v.video_token_id is not None else torch.zeros_like(visual, dtype=torch.bool)
        first = next(iter(parts.values()))[0]
        embeds = first.new_zeros(visual.numel(), first.shape[-1])
        levels = len(next(iter(parts.values()))[1])
        deepstack = [first.new_zeros(visual.numel(), first.shape[-1]) for _ in range(levels)]
        for kind, (emb, feats) in parts.items():
            rows = (is_video if kind == "video" else ~is_video).nonzero(as_tuple=True)[0].to(dev)
            embeds = embeds.index_copy(0, rows, emb)
            deepstack = [d.index_copy(0, rows, f) for d, f in zip(deepstack, feats)]
        return VisionContext(pos[:, 0], int(delta), embeds, deepstack)

    def prepare_contexts(self, contexts: list[list[int]], images: list[PromptImages | None] | None
                         ) -> list[VisionContext]:
        """`prepare_context` of every context (ValueError naming the context on bad inputs)."""
        out = []
        for i, (ids, im) in enumerate(zip(contexts, images or [None] * len(contexts))):
            try:
                out.append(self.prepare_context(ids, im))
            except ValueError as err:
                raise ValueError(f"context {i}: {err}") from None
        return out

    def prefill_inputs(self, tokens: torch.Tensor, contexts: list[VisionContext]) -> tuple[torch.Tensor, dict]:
        """(positions [3, B, L], the forward's keyword inputs: `embeds` [B, L, hidden], and with
        DeepStack features `deepstack` [levels, B, L, hidden], zero off the visual tokens) of
        right-aligned contexts in `tokens` [B, L] (left padding: position 0, the pad token's
        embedding, masked anyway)."""
        B, L = tokens.shape
        x = self.model.embed_tokens(tokens)
        positions = torch.zeros(3, B, L, dtype=torch.long, device=tokens.device)
        levels = max((len(c.deepstack) for c in contexts), default=0)
        addends = x.new_zeros(levels, B, L, x.shape[-1]) if levels else None
        for r, ctx in enumerate(contexts):
            n = ctx.positions.shape[1]
            positions[:, r, L - n:] = ctx.positions.to(tokens.device)
            if ctx.image_embeds is not None:
                mask = self.visual_mask(tokens[r])
                mask[:L - n] = False
                x[r, mask] = ctx.image_embeds.to(x.dtype)
                for k, feats in enumerate(ctx.deepstack):
                    addends[k, r, mask] = feats.to(x.dtype)
        return positions, ({"embeds": x} if addends is None else {"embeds": x, "deepstack": addends})

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As `DecoderLM.forward`; positions [B, T] (the same on all three axes) or [3, B, T];
        `embeds` [B, T, hidden] replaces the token embeddings (prefill with images)."""
        x = self.model.embed_tokens(tokens) if embeds is None else embeds
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.args.mrope_section, x.dtype)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.keys, cache.values):
            x = layer(x, cos, sin, k_cache, v_cache, start, mask)
        return self.lm_head(self.model.norm(x[:, -1])).float()


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] or [3, B, T] -> cos, sin [B, 1, T, head_dim] (HF `Qwen2_5_VLRotaryEmbedding`):
    freqs [3, B, T, d/2] = position * inv_freq (fp32); chunk c of `section` from axis c % 3."""
    if positions.dim() == 2:
        return rope_cos_sin(positions, inv_freq, 1.0, dtype)
    freqs = positions.float()[..., None] * inv_freq.float()
    freq = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(list(section), dim=-1))], dim=-1)
    emb = torch.cat((freq, freq), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


__all__ = ["VisionContext", "VisionLM", "VisionTower", "as_prompt_images", "check_images", "hf_param_name",
           "mrope_cos_sin", "qwen2_5_vl_args"]
