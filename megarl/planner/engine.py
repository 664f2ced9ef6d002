"""The rollout engine in the planner: its weights and KV pool per GPU, and one decode step.

An engine is parallel.rollout_tp GPUs (T; whole nodes when T > gpus_per_node: SGLang's nnodes).
With attention data parallelism (rollout.sglang_dp_size = D > 1, SGLang's enable_dp_attention)
the T GPUs form D attention groups of A = T / D GPUs; each group keeps its own sequences and
their KV cache. The MLP layers and the vocabulary span all T GPUs; routed experts split over
rollout.sglang_ep_size = E GPUs x T / E expert-TP (so T-way in every case, SGLang's moe_tp_size
= T / E). Weights are bf16, or one byte plus a float32 scale per 128 x 128 block
(rollout.weights_dtype=fp8, or a block-FP8 checkpoint) for every linear but the embeddings.

  weights per GPU  W = W_all / T + W_attn * (1 / A - 1 / T)      (W_attn: attention projections)
  KV per token     kv(A) = Arch.kv_bytes_per_token(A) per GPU of a group
  KV tokens        D * pool / kv(A) per engine (pool = mem_fraction * capacity - W)

One decode step of an engine running B sequences at mean context c (memory-bound in decode;
every routed expert is read: a batch of hundreds of tokens routes to nearly all of them):

  t_mem   = (W_lm + (B / D) * c * kv(A)) / (HBM bandwidth * eff)
  t_flops = 2 * N_active * B / (T * peak * eff)
  t_comm  = per layer, not overlapped with compute:
            D = 1: two all-reduces of B x h bf16 activations over the engine's T GPUs
                   (ring: 2 (T-1)/T of the message per GPU);
            D > 1: two all-reduces of (B / D) x h over the attention group when A > 1, and per
                   layer an all-gather of the engine's B tokens x h before the MLP and a
                   reduce-scatter after it ((T-1)/T of B x h bf16 per GPU each; SGLang's default
                   MoE path); with DeepEP (rollout.sglang_server_args moe_a2a_backend: deepep) an
                   MoE layer's dispatch and combine are all-to-alls of B / T tokens x top-k x h
                   bf16 per GPU instead;
            each collective costs latency + bytes / bandwidth, over NVLink inside a node and over
            InfiniBand once the engine spans nodes (GPU.link constants).
  step    = max(t_mem, t_flops) + t_comm

Where the constants come from: HBM bandwidth and peak FLOPs are the data-sheet figures
(megarl.planner.arch.GPUS); eff (--decode-eff, default 0.6) the fraction of them a decode step
attains; the link bandwidths are what DeepEP reports for its all-to-all kernels on H800
(~155 GB/s over NVLink, ~45 GB/s per GPU over 400 Gb/s InfiniBand) and the latencies (10 us, 40 us)
the order of its low-latency kernels' fixed cost. docs/cluster.md compares the resulting step
with NeMo-RL's published Qwen3-30B-A3B and Qwen3-235B-A22B figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.planner.arch import GPU, Arch
from megarl.planner.mla import engine_weight_bytes

NVLINK_BYTES_PER_S = 155e9
IB_BYTES_PER_S = 45e9
NVLINK_LATENCY_S = 10e-6
IB_LATENCY_S = 40e-6


@dataclass(frozen=True)
class EngineShape:
    tp: int  # GPUs per engine: parallel.rollout_tp
    dp: int = 1  # attention groups: rollout.sglang_dp_size
    ep: int = 1  # expert parallelism: rollout.sglang_ep_size
    fp8: bool = False  # rollout.weights_dtype=fp8 (a block-FP8 checkpoint is Arch.fp8)
    gpus_per_node: int = 8
    deepep: bool = False  # MoE dispatch / combine as all-to-alls (SGLang moe_a2a_backend: deepep)

    @classmethod
    def of(cls, cfg) -> "EngineShape":
        r, p = cfg.rollout, cfg.parallel
        deepep = dict(r.sglang_server_args).get("moe_a2a_backend") == "deepep"
        return cls(p.rollout_tp, r.sglang_dp_size, r.sglang_ep_size, r.weights_dtype == "fp8", p.gpus_per_node, deepep)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def nodes(self) -> int:
        return max(1, self.tp // self.gpus_per_node)


def attention_params(arch: Arch) -> int:
    """The attention projections of every layer (what DP attention replicates over its groups)."""
    return arch.layers * arch._attention_params()


def weight_bytes(arch: Arch, e: EngineShape, lm_only: bool = False) -> float:
    """Engine weights on one GPU (module doc: W_all / T + W_attn (1/A - 1/T)); lm_only: without
    the vision tower (what a decode step reads)."""
    fp8 = arch.fp8 or e.fp8
    total = arch.lm_params() if lm_only else arch.total_params()
    emb = arch.vocab * arch.hidden * (1 if arch.tie_embeddings else 2)
    per_param = (1.0 + 4.0 / (128 * 128)) if fp8 else 2.0
    return (engine_weight_bytes(total, emb, fp8) / e.tp
            + per_param * attention_params(arch) * (1.0 / e.attn_tp - 1.0 / e.tp))


def kv_tokens(arch: Arch, e: EngineShape, pool_bytes: float) -> float:
    """Tokens the engine's KV cache holds: D groups x pool / kv(A)."""
    return e.dp * max(pool_bytes, 0.0) / arch.kv_bytes_per_token(e.attn_tp)


def _collective_s(bytes_per_gpu: float, across_nodes: bool) -> float:
    if across_nodes:
        return IB_LATENCY_S + bytes_per_gpu / IB_BYTES_PER_S
    return NVLINK_LATENCY_S + bytes_per_gpu / NVLINK_BYTES_PER_S


def comm_s(arch: Arch, e: EngineShape, batch: float) -> float:
    """Communication of one decode step (module doc, t_comm)."""
    if e.tp == 1:
        return 0.0
    h, across = arch.hidden, e.nodes > 1
    if e.dp == 1:
        msg = batch * h * 2.0
        return arch.layers * 2 * _collective_s(2.0 * (e.tp - 1) / e.tp * msg, across)
    out = 0.0
    if e.attn_tp > 1:  # the attention group's all-reduces (inside a node when A <= gpus_per_node)
        msg = batch / e.dp * h * 2.0
        out += arch.layers * 2 * _collective_s(2.0 * (e.attn_tp - 1) / e.attn_tp * msg, e.attn_tp > e.gpus_per_node)
    gathered = batch * h * 2.0 * (e.tp - 1) / e.tp  # all-gather / reduce-scatter of the engine's tokens
    a2a_layers = arch.moe_layers if e.deepep else 0
    out += a2a_layers * 2 * _collective_s(batch / e.tp * h * 2.0 * arch.moe_topk, across)
    out += (arch.layers - a2a_layers) * 2 * _collective_s(gathered, across)
    return out


def decode_step(arch: Arch, e: EngineShape, gpu: GPU, batch: float, context: float, eff: float) -> dict[str, float]:
    """Seconds of one decode step of `batch` sequences at mean `context` tokens (module doc)."""
    kv_read = batch / e.dp * (context * arch.kv_bytes_per_token(e.attn_tp)
                              + 2 * arch.state_bytes_per_sequence(e.attn_tp))  # hybrid: state read and written
    t_mem = (weight_bytes(arch, e, lm_only=True) + kv_read) / (gpu.hbm_bytes_per_s * eff)
    t_flops = 2.0 * arch.active_params() * batch / (e.tp * gpu.bf16_flops * eff)
    t_comm = comm_s(arch, e, batch)
    return {"mem_s": t_mem, "flops_s": t_flops, "comm_s": t_comm, "step_s": max(t_mem, t_flops) + t_comm}
