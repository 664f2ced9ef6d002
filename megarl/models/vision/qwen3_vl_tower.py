"""The Qwen3-VL vision tower on megatron-core: patch embedding + resampled learned position table,
`depth` megatron `TransformerLayer`s (LayerNorm, 2D RoPE, full attention within each frame, non-gated
MLP), the 2x2 patch merger and the DeepStack mergers (megatron's `MultimodalProjector` after a
LayerNorm). Tensor parallel like the Qwen2.5-VL tower (`tower.py`): attention heads, fc1 and the
mergers' first linear column-parallel, `linear_proj` / fc2 row-parallel; patch embedding, position
table and norms replicated; no sequence or context parallelism inside the tower.

Forward (`Qwen3VisionTransformer.forward(pixel_values [N, C*tp*p*p], grid_thw [n, 3])`), as HF's
`Qwen3VLMoeVisionModel`:
1. x = Conv3d(pixel_values as [N, C, tp, p, p]) + bias + sum_k w_k table[i_k]
   (`qwen3_vl_geometry.position_table_taps`), patches in pixel_values (merge-block) order;
2. every block attends, without a causal mask, within each frame of each image (THD segments,
   `geometry.patch_cu_seqlens`), with the 2D RoPE angles of `geometry.vision_rope_angles`;
3. after block `deepstack_visual_indexes[j]`, DeepStack merger j maps its output to one feature per
   m x m block: LayerNorm(4c) of the concatenated block, Linear + GELU + Linear;
4. the merger maps the last block's output the same way, but with LayerNorm(c) before concatenating.
Returns (image embeddings [N / m^2, out_hidden_size], DeepStack features in block order).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megarl.models.vision import geometry
from megarl.models.vision.qwen3_vl_geometry import position_table_taps
from megarl.models.vision.tower import VisionCoreAttention, _packed, tower_config_common

# HF ACT2FN -> the same function in torch.nn.functional
_ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def qwen3_vision_configs(spec, lm_config):
    """(tower TransformerConfig, merger TransformerConfig) at the LM config's TP size and dtype."""
    from megatron.core.transformer import TransformerConfig

    v = spec.vision
    common = tower_config_common(lm_config, "LayerNorm", v.norm_eps)
    tower = TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.ffn_hidden_size,
        num_attention_heads=v.num_heads, num_query_groups=v.num_heads, kv_channels=v.head_dim,
        gated_linear_unit=False, activation_func=_ACTIVATIONS[v.hidden_act], add_qkv_bias=True, **common)
    merger = TransformerConfig(
        num_layers=1, hidden_size=v.out_hidden_size, ffn_hidden_size=v.merged_size,
        num_attention_heads=v.num_heads, kv_channels=v.head_dim, gated_linear_unit=False,
        activation_func=F.gelu, **common)
    return tower, merger


def qwen3_vision_layer_spec():
    """megatron's local GPT layer spec with LayerNorm and the non-causal segment attention."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    lspec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="LayerNorm")
    sub = lspec.submodules
    sub.self_attention = dataclasses.replace(sub.self_attention, params={"attn_mask_type": AttnMaskType.no_mask})
    sub.self_attention.submodules.core_attention = VisionCoreAttention
    return lspec


class Qwen3Merger(MegatronModule):
    """LayerNorm (over c before, or over m^2 c after, concatenating each m x m block) + MLP."""

    def __init__(self, config, merger_config, v, postshuffle_norm: bool):
        super().__init__(config=config)
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        self.postshuffle_norm = postshuffle_norm
        self.norm = torch.nn.LayerNorm(v.merged_size if postshuffle_norm else v.hidden_size, eps=v.norm_eps,
                                       dtype=config.params_dtype)
        self.mlp = MultimodalProjector(merger_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear),
                                       "mlp", input_size=v.merged_size)
        self.merged_size = v.merged_size

    def forward(self, x):  # x [N, 1, c] -> [N / m^2, 1, out]
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, 1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, 1, self.merged_size)
        return self.mlp(x)


class Qwen3VisionTransformer(MegatronModule):
    """Vision tower + merger + DeepStack mergers (module doc); parameter names mirror HF's
    `model.visual.*` (`qwen3_vl_bridge`)."""

    def __init__(self, spec, lm_config):
        config, merger_config = qwen3_vision_configs(spec, lm_config)
        super().__init__(config=config)
        from megatron.core.transformer.spec_utils import build_module

        v = spec.vision
        self.vision = v
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel,
                                                bias=True, dtype=config.params_dtype)
        self.pos_embed = torch.nn.Embedding(v.num_position_embeddings, v.hidden_size, dtype=config.params_dtype)
        lspec = qwen3_vision_layer_spec()
        self.blocks = torch.nn.ModuleList(
            [build_module(lspec, config=config, layer_number=i + 1) for i in range(v.depth)])
        self.merger = Qwen3Merger(config, merger_config, v, postshuffle_norm=False)
        self.deepstack_merger_list = torch.nn.ModuleList(
            [Qwen3Merger(config, merger_config, v, postshuffle_norm=True) for _ in v.deepstack_visual_indexes])
        self.register_buffer("inv_freq", geometry.vision_rope_inv_freq(v.head_dim, v.rope_theta), persistent=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """torch_dist entries: blocks and mergers through megatron's own methods (TP-sharded linears),
        the rest (patch embedding, position table) replicated."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import sharded_state_dict_default

        out, tp_group = {}, ps.get_tensor_model_parallel_group()  # replica ids count TP ranks
        for name, module in self.named_children():
            if isinstance(module, torch.nn.ModuleList):
                for i, item in enumerate(module):
                    out.update(sharded_state_dict_default(item, f"{prefix}{name}.{i}.", sharded_offsets, metadata,
                                                          tp_group=tp_group))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        return out

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        v, dev = self.vision, pixel_values.device
        m = v.spatial_merge_size
        hw = geometry.patch_hw_positions(grid_thw, m)
        if hw.shape[0] != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows, image_grid_thw "
                             f"describes {hw.shape[0]}")
        taps, tap_weights = position_table_taps(grid_thw, v.position_grid_side, m)
        proj = self.patch_embed.proj
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.reshape(proj.weight.shape[0], -1), proj.bias)
        pos = (self.pos_embed(taps.to(dev)) * tap_weights.to(dev)[:, :, None]).sum(1)
        x = (x + pos.to(x.dtype))[:, None]  # [N, 1, hidden]
        rope = geometry.vision_rope_angles(hw, self.inv_freq.cpu()).to(dev)[:, None, None, :]
        frames = _packed(geometry.patch_cu_seqlens(grid_thw), dev)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x, _ = block(x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=frames)
            if i in v.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x)[:, 0])
        return self.merger(x)[:, 0], deepstack
