"""The vision tower's part of the planner: its parameters and FLOPs from a vision-language
config.json (`VisionTower`), the image load the planner assumes (`Images`), and the layout rules
of the tower. See megarl/planner/__init__.py for the memory and time model they feed. (`Arch`
in the annotations is megarl.planner.arch.Arch, which holds a VisionTower: not imported here.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config import ConfigError, MegaRLConfig


# vision_config defaults of transformers' Qwen2_5_VLVisionConfig / Qwen3VLVisionConfig (a hub
# config.json may omit them: Qwen2.5-VL-32B's lists only the fields that differ)
VISION_DEFAULTS = {
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31]),
    "qwen3_vl": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                     num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
}
VISION_DEFAULTS["qwen3_vl_moe"] = VISION_DEFAULTS["qwen3_vl"]
# Qwen3.5: the Qwen3-VL tower without DeepStack (transformers' Qwen3_5VisionConfig)
VISION_DEFAULTS["qwen3_5"] = VISION_DEFAULTS["qwen3_5_moe"] = {**VISION_DEFAULTS["qwen3_vl"], "deepstack_visual_indexes": []}
DEFAULT_IMAGE_PIXELS = 512 * 512  # a Geometry3K-sized diagram



@dataclass(frozen=True)
class VisionTower:
    """Vision tower of a vision-language config.json (its vision_config), c = hidden, f = ffn,
    m = spatial merge, u = c * m^2 (the merger's width), out = the LM's hidden size.

    Qwen2.5-VL (qwen2_5_vl): patch embedding Conv3d without bias, `depth` blocks of RMSNorm (c),
    fused qkv (3c x c + 3c), proj (c x c + c), SwiGLU MLP with biases (gate, up: f x c + f;
    down: c x f + c); windowed attention (window_size px) except fullatt_block_indexes; merger
    RMSNorm(c), Linear(u, u), GELU, Linear(u, out).
    Qwen3-VL (qwen3_vl, qwen3_vl_moe; Qwen3.5's qwen3_5, qwen3_5_moe without DeepStack): LayerNorm (weight + bias), GELU MLP (fc1: f x c + f; fc2:
    c x f + c), patch embedding with bias, a learned position table (num_position_embeddings x c),
    full attention in every block, the merger with LayerNorm(c), and one DeepStack merger per
    deepstack_visual_indexes (LayerNorm over u, then the same two linears).

    Tensor parallelism as megarl shards the Qwen2.5-VL tower (megarl.models.vision.bridge; the
    Qwen3-VL tower is assumed to follow it): every linear's weight and the column-parallel biases
    (qkv, gate / up / fc1, merger fc1) split over TP; norms, patch embedding, position table and
    the row-parallel biases (proj, down / fc2, merger fc2) replicated. No SP, CP or recompute inside
    the tower; it lives on the first pipeline stage."""

    depth: int
    hidden: int
    ffn: int
    heads: int
    patch: int
    temporal_patch: int
    in_channels: int
    merge: int
    out_hidden: int
    gated_mlp: bool
    layer_norm: bool
    patch_bias: bool
    pos_embeddings: int = 0
    deepstack: int = 0
    window: int = 0  # attention window side in patches (0: every block attends over the whole image)
    full_blocks: int = 0  # blocks with full attention when windowed

    @classmethod
    def from_hf(cls, hf: dict) -> "VisionTower":
        model_type = hf.get("model_type", "")
        if model_type not in VISION_DEFAULTS:
            raise ConfigError(f"planner: vision-language model_type {model_type!r} is not modelled "
                              f"({', '.join(VISION_DEFAULTS)} are)")
        v = {**VISION_DEFAULTS[model_type], **(hf.get("vision_config") or {})}
        qwen25 = model_type == "qwen2_5_vl"
        patch = int(v["patch_size"])
        return cls(
            depth=v["depth"], hidden=v["hidden_size"], ffn=v["intermediate_size"], heads=v["num_heads"],
            patch=patch, temporal_patch=int(v["temporal_patch_size"]), in_channels=v["in_channels"],
            merge=v["spatial_merge_size"], out_hidden=v["out_hidden_size"], gated_mlp=qwen25, layer_norm=not qwen25,
            patch_bias=not qwen25, pos_embeddings=0 if qwen25 else v["num_position_embeddings"],
            deepstack=0 if qwen25 else len(v["deepstack_visual_indexes"]),
            window=v["window_size"] // patch if qwen25 else 0,
            full_blocks=len(v["fullatt_block_indexes"]) if qwen25 else v["depth"])

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: C * tp * p * p."""
        return self.in_channels * self.temporal_patch * self.patch**2

    @property
    def merged(self) -> int:
        """u = c * m^2, the width of a merged token."""
        return self.hidden * self.merge**2

    def _norm(self, width: int) -> int:
        return 2 * width if self.layer_norm else width  # LayerNorm: weight + bias; RMSNorm: weight

    def block_params(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one block: qkv 3c^2 + 3c, proj c^2, MLP
        k*(f*c + f) + c*f (k = 2 gated, 1 plain) split; proj and down / fc2 biases (2c) and the two
        norms replicated."""
        c, f = self.hidden, self.ffn
        sharded = 3 * c * c + 3 * c + c * c + (2 if self.gated_mlp else 1) * (f * c + f) + c * f
        return sharded, 2 * c + 2 * self._norm(c)

    def merger_params(self, deepstack: bool = False) -> tuple[int, int]:
        """(TP-sharded, replicated) of one merger: fc1 u^2 + u, fc2 weight out*u split; fc2 bias
        and the norm (over c; over u for a DeepStack merger) replicated."""
        u, out = self.merged, self.out_hidden
        return u * u + u + out * u, out + self._norm(u if deepstack else self.hidden)

    def embed_params(self) -> int:
        """Replicated: patch embedding c * C*tp*p*p (+ c bias) and the position table."""
        c = self.hidden
        return c * self.patch_dim + (c if self.patch_bias else 0) + self.pos_embeddings * c

    def split_params(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of the whole tower."""
        bs, br = self.block_params()
        ms, mr = self.merger_params()
        ds, dr = self.merger_params(deepstack=True)
        return (self.depth * bs + ms + self.deepstack * ds,
                self.embed_params() + self.depth * br + mr + self.deepstack * dr)

    def total_params(self) -> int:
        return sum(self.split_params())

    def stage_params(self, tp: int) -> float:
        """Tower parameters on one GPU of the first stage: sharded / TP + replicated."""
        sharded, replicated = self.split_params()
        return sharded / tp + replicated

    def image_tokens(self, pixels: int) -> int:
        """LM tokens of a square image of `pixels` pixels after Qwen's smart_resize (sides rounded
        to multiples of p * m): (side / (p*m))^2; it feeds the tower tokens * m^2 patches."""
        f = self.patch * self.merge
        side = max(1, round(math.sqrt(pixels) / f))
        return side * side

    def forward_flops(self, patches: int) -> float:
        """Forward FLOPs of one image of `patches` patches: 2 per weight per patch through the patch
        embedding and blocks (c * C*tp*p*p + depth * (4c^2 + k*f*c), k = 3 gated / 2 plain), 2 per
        weight per merged token (patches / m^2) through the (1 + DeepStack) mergers (u^2 + out*u),
        and non-causal attention 4 * patches * ctx * c per block (ctx = window^2 patches in the
        windowed blocks, the image's patches in the full-attention ones)."""
        c, f, u = self.hidden, self.ffn, self.merged
        linear = c * self.patch_dim + self.depth * (4 * c * c + (3 if self.gated_mlp else 2) * f * c)
        mergers = (1 + self.deepstack) * (u * u + self.out_hidden * u) * patches / self.merge**2
        windowed = self.depth - self.full_blocks
        ctx = self.full_blocks * patches + windowed * min(self.window**2, patches)
        return 2.0 * linear * patches + 2.0 * mergers + 4.0 * patches * ctx * c


@dataclass(frozen=True)
class Images:
    """The image load the planner assumes for a vision-language model: `per_sample` images of
    `tokens` LM tokens each (placeholder tokens, after the m x m merge; from --image-tokens or
    --image-pixels), i.e. tokens * m^2 tower patches; `per_microbatch` images in one micro-batch
    (--images-per-microbatch), else as many samples as a micro-batch holds at the mean sample
    length (plan.mean_lengths), times per_sample."""

    per_sample: int
    tokens: int
    merge: int
    per_microbatch: int | None = None

    @property
    def sample_tokens(self) -> int:
        return self.per_sample * self.tokens

    @property
    def patches(self) -> int:
        """Tower patches of one image: tokens * m^2."""
        return self.tokens * self.merge**2

    def in_microbatch(self, budget: int, mean_sample: float) -> int:
        """Images in one micro-batch of `budget` tokens: per_microbatch, else
        max(1, floor(budget / mean_sample)) samples x per_sample."""
        if self.per_microbatch is not None:
            return self.per_microbatch
        return max(1, int(budget // max(mean_sample, 1))) * self.per_sample


def image_load(arch, per_sample: int = 1, pixels: int = DEFAULT_IMAGE_PIXELS, tokens: int | None = None,
               per_microbatch: int | None = None) -> Images | None:
    """The assumed `Images` of a vision-language model (None for a text model)."""
    if arch.vision is None:
        return None
    return Images(per_sample, tokens if tokens is not None else arch.vision.image_tokens(pixels), arch.vision.merge,
                  per_microbatch)


def microbatch_patches(cfg: MegaRLConfig, role: str, images: Images | None, mean_sample: float) -> int:
    """Vision-tower patches of one `role` micro-batch: Images.in_microbatch(budget, mean sample
    length) images x tokens * m^2 patches (0 for a text model)."""
    if images is None:
        return 0
    return images.in_microbatch(getattr(cfg, role).max_tokens_per_microbatch, mean_sample) * images.patches


def vision_problems(arch, cfg: MegaRLConfig, images: Images | None) -> list[str]:
    """Layout rules of the vision tower (megatron's column-parallel linears split heads and the MLP
    over TP) and prompts with room for the assumed images."""
    v, tp, out = arch.vision, cfg.parallel.tp, []
    if v is None:
        return out
    if v.heads % tp or v.ffn % tp:
        out.append(f"parallel.tp={tp}: the vision tower's num_heads={v.heads} and intermediate_size={v.ffn} "
                   "must both divide by tp")
    if images and images.sample_tokens >= cfg.data.max_prompt_len:
        out.append(f"data.max_prompt_len={cfg.data.max_prompt_len} counts image tokens and leaves no room for "
                   f"{images.per_sample} x {images.tokens} image tokens: every prompt would be skipped")
    return out
