"""megarl's gated delta-net layer for the local layer spec (the linear-attention layers of Qwen3-Next
and Qwen3.5), on packed sequences, with tensor parallelism over heads.

megatron-core 0.16.1's `megatron.core.ssm.gated_delta_net.GatedDeltaNet` cannot serve here: it
refuses to be built without flash-linear-attention (so not on CPU), raises on packed sequences
(`NotImplementedError`) and has no inference path. This module keeps its parameter names and
TP layout (so its `sharded_state_dict`, borrowed below, saves and reloads torch_dist checkpoints
under any TP):

- `in_proj` (column-parallel, hidden -> per TP rank [q | k | v | z | b | a] of that rank's heads:
  num_key_heads / tp key heads of d_k, num_value_heads / tp value heads of d_v, and one b and one a
  per value head), `conv1d.weight` [(2 d_k n_k + d_v n_v) / tp, 1, K] over the rank's q | k | v
  channels, `A_log` and `dt_bias` [n_v / tp], `out_norm.weight` [d_v] (replicated), `out_proj`
  (row-parallel, value heads -> hidden).

Forward (`megarl.models.gdn_kernels` for the formulas), for the hidden states [s, b, h] of
megatron's layer (THD: one packed row, b = 1, sequences delimited by `packed_seq_params`; BSHD:
every batch row one sequence):

    [q k v z b a] = in_proj(x);  q k v = silu(causal_conv(q k v))  restarted per sequence
    g, beta = gates(a, b);  o = gated_delta_rule(q, k, v, g, beta)  state restarted per sequence
    y = out_proj( rmsnorm(o) * out_norm.weight * silu(z) )     (per value head, in float32)

A value head j reads key head j // (n_v / n_k), which lives on the same TP rank. `out_norm.weight`
is shared by every head, so each TP rank's gradient is a partial sum over its heads: the weight
enters through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward).

Context parallelism: not supported (megatron-core 0.16.1 has no GDN context parallelism either):
the layer raises, and the config refuses `parallel.cp > 1` for these models at load time.
The kernel is chosen per call like the attention kernels (`gdn_kernels.select_gdn_kernel`:
flash-linear-attention on a GPU in bf16 / fp16, verified only on GPU; torch elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megarl.models import gdn_kernels as K


@dataclass(frozen=True)
class GDNSpec:
    """Gated delta-net facts of a hybrid model: which layers are linear attention (0-based global
    indices; the rest are full attention), the head layout, the conv kernel, and the HF naming of
    the input projection ("qwen3_next": `in_proj_qkvz` / `in_proj_ba` grouped by key head;
    "qwen3_5": `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`)."""

    linear_layers: tuple[int, ...]
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    hf_layout: str

    @property
    def key_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def value_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_dim(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads

    def in_proj_sections(self, tp: int) -> list[int]:
        """Rows of one TP rank's in_proj: [q, k, v, z, b, a]."""
        nk, nv = self.num_key_heads // tp, self.num_value_heads // tp
        return [nk * self.key_head_dim, nk * self.key_head_dim, nv * self.value_head_dim,
                nv * self.value_head_dim, nv, nv]


class GatedRMSNorm(torch.nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) * silu(z) over the last dim, normalised and gated in
    float32, the weight multiply in x's dtype (transformers' `Qwen3NextRMSNormGated`); the weight's
    gradient is summed over TP ranks (module doc)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        dtype = x.dtype
        weight = self.weight
        if ps.get_tensor_model_parallel_world_size() > 1 and torch.is_grad_enabled():
            weight = copy_to_tensor_model_parallel_region(weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)


def _full_then_shard(make, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of a full tensor drawn from the global RNG (the same draws on every TP rank,
    as megatron's CPU initialisation), so a model initialises the same at any TP."""
    full = make()
    per = full.shape[0] // tp
    return full[rank * per:(rank + 1) * per].clone()


class GatedDeltaNet(MegatronModule):
    """The linear-attention layer (module doc); built by megatron's `TransformerLayer` as its
    `self_attention` from a `ModuleSpec(GatedDeltaNet, params={"gdn": GDNSpec})`."""

    def __init__(self, config, submodules=None, layer_number: int | None = None, gdn: GDNSpec | None = None,
                 pg_collection=None, **unused):
        super().__init__(config)
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if gdn is None:
            raise ValueError("GatedDeltaNet needs its GDNSpec (ModuleSpec params={'gdn': ...})")
        self.gdn, self.layer_number = gdn, layer_number
        self.pg_collection = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self.tp_size = tp = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        if gdn.num_key_heads % tp or gdn.num_value_heads % tp:
            raise ValueError(f"gated delta-net heads ({gdn.num_key_heads} key, {gdn.num_value_heads} value) must "
                             f"divide by the tensor-parallel size {tp}")
        # the attribute names megatron's GatedDeltaNet.sharded_state_dict reads
        self.qk_dim, self.v_dim, self.num_value_heads = gdn.key_dim, gdn.value_dim, gdn.num_value_heads
        self.in_proj_dim, self.conv_bias = gdn.in_proj_dim, False
        self.conv_dim_local_tp = gdn.conv_dim // tp
        self.sections = gdn.in_proj_sections(tp)
        dtype = config.params_dtype
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, gdn.in_proj_dim, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_bias_add=False, is_expert=False, tp_group=self.pg_collection.tp)
        width = gdn.conv_kernel
        self.conv1d = torch.nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp, width, bias=False,
                                      groups=self.conv_dim_local_tp, padding=width - 1, dtype=dtype)
        bound = width ** -0.5  # nn.Conv1d's default: kaiming_uniform(a=sqrt(5)) on fan_in = K
        self.conv1d.weight.data.copy_(_full_then_shard(
            lambda: torch.empty(gdn.conv_dim, 1, width).uniform_(-bound, bound), tp_rank, tp))
        self.dt_bias = torch.nn.Parameter(torch.ones(gdn.num_value_heads // tp, dtype=dtype))
        self.A_log = torch.nn.Parameter(_full_then_shard(
            lambda: torch.empty(gdn.num_value_heads).uniform_(1, 16).log(), tp_rank, tp).to(dtype))
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = GatedRMSNorm(gdn.value_head_dim, config.layernorm_epsilon, dtype)
        self.out_proj = RowParallelLinear(
            gdn.value_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=self.pg_collection.tp)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None:
            raise NotImplementedError("megarl's gated delta-net has no megatron inference path (the rollout "
                                      "engines generate)")
        if self.cp_size > 1:
            raise ValueError("gated delta-net layers do not support context parallelism (parallel.cp must be 1)")
        mixed, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp]
        s, b = mixed.shape[:2]
        cu, cache = self._boundaries(packed_seq_params, s, b)
        out = self.mix(mixed.transpose(0, 1).reshape(b * s, -1), cu, cache)
        return self.out_proj(out.reshape(b, s, -1).transpose(0, 1).contiguous())

    @staticmethod
    def _boundaries(params, s: int, b: int):
        if params is not None and params.qkv_format == "thd":
            from megarl.models.attention import _row_boundaries

            cu, _, cache = _row_boundaries(params)
            if cu[-1] != s * b:
                raise ValueError(f"packed boundaries end at {cu[-1]}, the row holds {s * b} tokens")
            return cu, cache
        return [i * s for i in range(b + 1)], {}

    def mix(self, mixed: torch.Tensor, cu: list[int], cache: dict | None = None) -> torch.Tensor:
        """Token mixing of a packed row: in_proj outputs [T, in_proj_dim / tp] -> gated, normed head
        outputs [T, n_v / tp * d_v] (the out_proj input); every sequence of `cu` starts afresh."""
        gdn, cache = self.gdn, {} if cache is None else cache
        q_dim, _, v_dim, _, heads, _ = self.sections
        qkv, z, b, a = mixed.split([2 * q_dim + v_dim, v_dim, heads, heads], dim=-1)
        weight = self.conv1d.weight[:, 0]
        kernel = K.select_gdn_kernel(mixed.device.type, mixed.dtype)
        if kernel == "fla":
            cu_dev = _cached(cache, "gdn_cu", lambda: torch.tensor(cu, dtype=torch.long, device=mixed.device))
            qkv = K.fla_causal_conv1d(qkv, weight, cu_dev)
        else:
            positions = _cached(cache, "gdn_positions", lambda: K.sequence_positions(cu, mixed.device))
            qkv = K.causal_conv1d_packed(qkv, weight, cu, positions)
        t = mixed.shape[0]
        q, k, v = qkv.split([q_dim, q_dim, v_dim], dim=-1)
        ratio = gdn.num_value_heads // gdn.num_key_heads
        q = q.reshape(t, -1, gdn.key_head_dim).repeat_interleave(ratio, dim=1)
        k = k.reshape(t, -1, gdn.key_head_dim).repeat_interleave(ratio, dim=1)
        v = v.reshape(t, -1, gdn.value_head_dim)
        g, beta = K.gdn_gates(a, b, self.A_log, self.dt_bias)
        if kernel == "fla":
            o = K.fla_gated_delta_rule(q, k, v, g, beta, cu_dev)
        else:
            o, _ = K.chunk_gated_delta_rule(q, k, v, g, beta, cu)
        o = self.out_norm(o, z.reshape(t, -1, gdn.value_head_dim))
        return o.reshape(t, -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """megatron-core's GatedDeltaNet checkpoint layout (this module keeps its names and shapes)."""
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN

        return MegatronGDN.sharded_state_dict(self, prefix, sharded_offsets, metadata, tp_group)


def _cached(cache: dict, key, make):
    if key not in cache:
        cache[key] = make()
    return cache[key]
