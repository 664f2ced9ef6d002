"""The Qwen2.5-VL vision tower on megatron-core: patch embedding, `depth` megatron
`TransformerLayer`s (2D RoPE, windowed / full attention), and the 2x2 patch merger (megatron's
`MultimodalProjector`). Tensor parallel like the LM: attention heads, the SwiGLU MLP and the merger's
first linear are column-parallel, `linear_proj` / fc2 row-parallel; patch embedding and norms are
replicated. No sequence or context parallelism inside the tower (its tokens are replicated over TP).

Forward (`VisionTransformer.forward(pixel_values [N, C*tp*p*p], grid_thw [n, 3])`), as HF:
1. x = Conv3d(pixel_values as [N, C, tp, p, p]) -> [N, hidden];
2. the patches are reordered window by window (`geometry.window_partition`, merge blocks of m^2
   patches kept together), and so are their 2D RoPE angles (`geometry.vision_rope_angles`);
3. every block attends, without a causal mask, within its segments: the windows
   (`cu_window_seqlens`), or each frame of each image in `fullatt_block_indexes`; the segments
   reach megatron's attention as THD `PackedSeqParams`, which also makes megatron apply each
   token's own rotary angles (the rotary tensor is as long as the packed row);
4. the merger maps each m x m block (consecutive after step 2) to one LLM embedding, and the
   window order is undone: out [N / m^2, out_hidden_size] in pixel_values order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megarl.models.vision import geometry


class VisionCoreAttention(torch.nn.Module):
    """Non-causal attention within segments, for megatron's `SelfAttention` (core attention slot).

    q, k, v arrive as THD [t, heads, d] with `packed_seq_params.cu_seqlens_q` delimiting the
    segments; out[t] = softmax(q k^T * scale) v over the keys of the query's own segment."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("the vision tower's attention takes THD inputs with cu_seqlens")
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))  # [1, h, n, d]
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=self.scale)[0].transpose(0, 1))
        out = torch.cat(outs) if outs else query.new_zeros(query.shape)
        return out.reshape(out.shape[0], -1)


def tower_config_common(lm_config, normalization: str, eps: float) -> dict:
    """TransformerConfig fields shared by the vision towers and mergers: the LM config's TP size
    and dtype, no PP / CP / SP inside the tower, no dropout, biases, no fused kernels."""
    return dict(
        tensor_model_parallel_size=lm_config.tensor_model_parallel_size, pipeline_model_parallel_size=1,
        context_parallel_size=1, sequence_parallel=False, params_dtype=lm_config.params_dtype,
        pipeline_dtype=lm_config.params_dtype, bf16=lm_config.bf16, fp16=lm_config.fp16,
        use_cpu_initialization=lm_config.use_cpu_initialization, init_method_std=lm_config.init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # megatron rejects its allgather default with variable lengths
        normalization=normalization, layernorm_epsilon=eps, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)


def vision_configs(spec, lm_config):
    """(tower TransformerConfig, merger TransformerConfig) at the LM config's TP size and dtype."""
    from megatron.core.transformer import TransformerConfig

    v = spec.vision
    common = tower_config_common(lm_config, "RMSNorm", v.norm_eps)
    tower = TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.ffn_hidden_size,
        num_attention_heads=v.num_heads, num_query_groups=v.num_heads, kv_channels=v.head_dim,
        gated_linear_unit=True, activation_func=F.silu, add_qkv_bias=True, **common)
    merger = TransformerConfig(
        num_layers=1, hidden_size=v.out_hidden_size, ffn_hidden_size=v.merged_size,
        num_attention_heads=v.num_heads, kv_channels=v.head_dim, gated_linear_unit=False,
        activation_func=F.gelu, **common)
    return tower, merger


def vision_layer_spec():
    """megatron's local GPT layer spec with megarl's RMSNorm and the non-causal segment attention."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.norm import RMSNorm

    lspec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    sub = lspec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention = dataclasses.replace(sub.self_attention, params={"attn_mask_type": AttnMaskType.no_mask})
    sub.self_attention.submodules.core_attention = VisionCoreAttention
    return lspec


def _packed(cu: list[int], device):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


class _Merger(MegatronModule):
    def __init__(self, config, merger_config, v):
        super().__init__(config=config)
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        from megarl.models.norm import RMSNorm

        self.unit = v.spatial_merge_size**2
        self.ln_q = RMSNorm(config, v.hidden_size, eps=v.norm_eps)
        self.mlp = MultimodalProjector(merger_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear),
                                       "mlp", input_size=v.merged_size)

    def forward(self, x):  # x [N, 1, c] -> [N / m^2, 1, out]
        x = self.ln_q(x)
        return self.mlp(x.reshape(x.shape[0] // self.unit, 1, -1))


class VisionTransformer(MegatronModule):
    """Vision tower + merger (module doc); parameter names mirror HF's `visual.*`."""

    def __init__(self, spec, lm_config):
        config, merger_config = vision_configs(spec, lm_config)
        super().__init__(config=config)
        from megatron.core.transformer.spec_utils import build_module

        v = spec.vision
        self.vision = v
        proj = torch.nn.Conv3d(v.in_channels, v.hidden_size, bias=False,
                               kernel_size=(v.temporal_patch_size, v.patch_size, v.patch_size),
                               stride=(v.temporal_patch_size, v.patch_size, v.patch_size))
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = proj.to(config.params_dtype)
        lspec = vision_layer_spec()
        self.blocks = torch.nn.ModuleList(
            [build_module(lspec, config=config, layer_number=i + 1) for i in range(v.depth)])
        self.merger = _Merger(config, merger_config, v)
        self.register_buffer("inv_freq", geometry.vision_rope_inv_freq(v.head_dim, v.rope_theta), persistent=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """torch_dist entries: each block through megatron's own TransformerLayer method (TP-sharded
        linears), the rest as megatron's default (replicated patch embedding and norms)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import sharded_state_dict_default

        out, tp_group = {}, ps.get_tensor_model_parallel_group()  # replica ids count TP ranks
        for name, module in self.named_children():
            if name == "blocks":
                for i, block in enumerate(module):
                    out.update(block.sharded_state_dict(f"{prefix}blocks.{i}.", sharded_offsets, metadata))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        return out

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        v, dev = self.vision, pixel_values.device
        m = v.spatial_merge_size
        window_index, cu_window = geometry.window_partition(grid_thw, m, v.window_size, v.patch_size)
        order = geometry.patch_order(window_index, m)
        if order.numel() != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows, image_grid_thw "
                             f"describes {order.numel()}")
        angles = geometry.vision_rope_angles(geometry.patch_hw_positions(grid_thw, m)[order], self.inv_freq.cpu())
        w = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1))  # == Conv3d with kernel = stride
        x = x[order.to(dev)][:, None]  # [N, 1, hidden] in window order
        rope = angles.to(dev)[:, None, None, :]  # [N, 1, 1, head_dim]
        full, window = _packed(geometry.patch_cu_seqlens(grid_thw), dev), _packed(cu_window, dev)
        for i, block in enumerate(self.blocks):
            psp = full if i in v.fullatt_block_indexes else window
            x, _ = block(x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=psp)
        out = self.merger(x)[:, 0]
        return out[torch.argsort(window_index).to(dev)]
