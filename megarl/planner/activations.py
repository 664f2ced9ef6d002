"""Train-phase activation memory of the planner (bytes per GPU), and why a train phase overflows.

Activations, per micro-batch of s = max_tokens_per_microbatch / CP tokens per GPU (context
parallelism splits every sequence over CP GPUs), following the accounting of Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models" (Eq. 1-4: 34*s*h + 5*a*s^2
bytes per layer for GPT, i.e. 10*s*h replicated + 24*s*h TP-sharded + 5*a*s^2 attention scores;
all TP-sharded with sequence parallelism), generalised to GQA and gated MLPs and with dropout
masks dropped (Qwen uses dropout 0):
    per token and layer   R = 8h             (2 norm inputs, QKV input, FC1 input; bf16)
                          S = 4*a*d + 4*g*d  (Q and attention output; K and V)
                            + 6*f            (gated FC1 output 2f, FC2 input f; bf16)
                            + C              (core attention: 5*a*S_seq for unfused attention as in
                                              Korthikanti, over the whole sequence's keys; 4*a
                                              (fp32 log-sum-exp) for flash attention; for megarl's
                                              local attention 2*a*d + 4*a (bf16 output and fp32
                                              log-sum-exp of torch's varlen flash kernel, bf16/fp16
                                              models) or 4*a*d + 4*a (fp32 output and log-sum-exp of
                                              the blockwise path, fp32 models); 0 with selective
                                              recompute)
    bytes = s * (R + S/TP) without SP, s * (R + S)/TP with SP.
    full recompute keeps only each chunk's input (2h per token, /TP with SP) plus one chunk
    being recomputed; 1F1B keeps PP micro-batches in flight on the first stage
    (PP * (1 + (PP-1)/(PP*VPP)) with interleaving).
CP K/V exchange, B = max_tokens_per_microbatch (the whole packed row), e = 2 bytes (4 in fp32):
    megarl's local attention (transformer_impl local) all-gathers every layer's K and V,
    2 * B * (g/TP) * d * e per layer; the blockwise path (fp32) keeps that for the backward, the
    varlen path (bf16/fp16) keeps the keys of each local chunk's prefix instead, (2CP+1)/(2CP)
    times as many rows, and the gathered K/V is transient; with selective recompute nothing is
    kept (one layer's worth, transient). TE's ring p2p (other impls) keeps about two K/V chunks in
    flight: 2 * 2 * (B/CP) * (g/TP) * d * e, transient.
attention workspace (local attention, blockwise path only): fp32 scores, probabilities, dP, dS of
    one block of queries over the sequence's keys, 16 * block * S_seq * a/TP bytes, transient
    (block: 16 to 512 queries, sized by the attention to keep one block's scores near 32 MiB); the
    varlen flash kernel keeps its blocks on chip (0).
logits (last stage, actor): log-probs and entropy run over chunks of c = model.logprob_chunk_tokens
    tokens: s * V/TP * 4 (bf16 logits + their bf16 gradient) + min(c, s) * V/TP * 12 (one
    chunk's fp32 logits, softmax and gradient), never fp32 logits of the whole micro-batch.
Mixture of experts (megatron's MoE layer, alltoall token dispatcher; megatron requires SP at
    TP > 1, so a GPU routes its t = s/TP tokens, t = s at TP = 1). E experts, top k, expert FFN
    f_e, ETP = parallel.etp or TP, u = the routing imbalance (tokens the busiest EP rank receives
    over the mean k*t; RL runs without a load-balancing loss). The MLP term 6f of S becomes 6*f_s
    for a shared expert (0 without one), and per local token and layer the MoE layer keeps
        M = 8E              (router logits and probabilities, fp32)
          + 2*k*ETP*h * u   (the expert inputs: k routed copies, all-gathered over expert-TP)
          + 6*k*f_e * u     (SwiGLU FC1 output 2*f_e/ETP and FC2 input f_e/ETP, bf16, of k*t*ETP
                             routed copies)
          + 2*k*h           (expert outputs back on the source rank: the probabilities' gradient)
    bytes = s * ((R + S)/TP + M/TP) (SP; s * (R + S/TP + M) at TP = 1).
    Transient, one layer at a time (moe_buffers): the dispatcher's permuted send buffer and
    receive buffer, 2*k*t*h + 2*k*t*h*u bytes (+ 2*k*t*ETP*h*u for the expert-TP all-gather when
    ETP > 1), and the grouped GEMM's gradient buffers of the FC1 output and FC2 input in the
    backward, 6*k*t*f_e*u bytes.
Hybrid models (Qwen3-Next, Qwen3.5): the attention terms are the mean over the layers of the gated
    attention layers' (4*a*d + 4*g*d + C + 4*a*d for the gate and the gated output) and the
    delta-net layers' (megarl/planner/hybrid.py).
Vision tower (vision-language models; first pipeline stage, so x the micro-batches in flight
    there): P patches per micro-batch (plan.microbatch_patches: images x tokens * m^2), replicated
    over TP (no SP, no CP) and never recomputed (megarl's tower config has no recompute), c the
    tower width, f its MLP width, a its heads; per patch
        depth * (8c + (8c + k*f + 4a) / TP)     (per block, as R and S above with g = a, a*d = c:
                                                  norms' and QKV / FC1 inputs 8c replicated; Q, K, V
                                                  and attention output 8c, the MLP's k*f = 6f gated /
                                                  4f GELU, the attention kernel's fp32 log-sum-exp 4a)
      + (1 + DeepStack) * (4c + 4c / TP)         (each merger: norm and FC1 inputs 4c replicated, FC1
                                                  output and FC2 input 2*u/m^2 = 2c each, split)
      + 2 * C*tp*p*p                             (the bf16 pixel rows the patch embedding keeps)
    bytes = P * that (small terms -- rotary angles, LayerNorm statistics -- left out).
"""

from __future__ import annotations

import math

from megarl.config import MegaRLConfig

from megarl.planner.arch import Arch, ModelState

GIB = 1024**3


LOCAL_SCORE_BLOCK_BYTES = 32 << 20  # megarl.models.attention_blockwise.SCORE_BLOCK_BYTES: one query block's fp32 scores


def local_varlen(cfg: MegaRLConfig) -> bool:
    """Whether megarl's local attention runs torch's varlen flash kernel on the cluster's GPUs (a
    bf16 / fp16 model; fp32 runs the blockwise path): megarl.models.attention_kernels.select_kernel."""
    return cfg.model.transformer_impl == "local" and cfg.model.dtype != "fp32"


def core_attention_bytes_per_token(arch: Arch, cfg: MegaRLConfig, seq_len: float) -> float:
    """Bytes per token and layer (before TP sharding) the core attention keeps for its backward.

    selective recompute: 0 (the core attention is recomputed). megarl's local attention
    (transformer_impl local): the varlen kernel's bf16 output and fp32 log-sum-exp, 2*a*d + 4*a,
    or the blockwise path's float32 output and log-sum-exp, 4*a*d + 4*a (fp32 models). Unfused
    attention (attention_backend unfused under TE; `local` is refused there): Korthikanti's 5*a*s over the keys of
    the sequence (s = seq_len, the whole sequence also under CP). Flash / fused: 4*a (log-sum-exp).
    """
    m = cfg.model
    a, d = arch.heads, arch.head_dim
    if m.recompute == "selective":
        return 0.0
    if m.transformer_impl == "local":
        return (2.0 if local_varlen(cfg) else 4.0) * a * d + 4.0 * a
    if m.attention_backend == "unfused":
        return 5.0 * a * seq_len
    return 4.0 * a


def moe_bytes_per_local_token(arch: Arch, cfg: MegaRLConfig, imbalance: float = 1.0) -> float:
    """M of the module doc: bytes an MoE layer keeps for the backward per token the GPU routes."""
    if not arch.num_experts:
        return 0.0
    h, k, fe, etp = arch.hidden, arch.moe_topk, arch.moe_ffn, cfg.parallel.etp or cfg.parallel.tp
    return 8.0 * arch.num_experts + (2.0 * k * etp * h + 6.0 * k * fe) * imbalance + 2.0 * k * h


def moe_buffer_bytes(arch: Arch, cfg: MegaRLConfig, local_tokens: float, imbalance: float = 1.0) -> float:
    """Transient dispatcher + grouped GEMM buffers of one MoE layer for `local_tokens` routed
    tokens (module doc): 2kth + 2kthu (+ 2k*t*ETP*h*u at ETP > 1) + 6k*t*f_e*u bytes."""
    if not arch.num_experts:
        return 0.0
    h, k, fe, etp = arch.hidden, arch.moe_topk, arch.moe_ffn, cfg.parallel.etp or cfg.parallel.tp
    t = local_tokens
    dispatch = 2.0 * k * t * h + 2.0 * k * t * h * imbalance + (2.0 * k * t * etp * h * imbalance if etp > 1 else 0.0)
    return dispatch + 6.0 * k * t * fe * imbalance


def activation_bytes_per_token_layer(arch: Arch, cfg: MegaRLConfig, seq_len: float, moe_imbalance: float = 1.0,
                                     moe_layer: bool = True) -> float:
    """Bytes kept per token per layer for backward (see module doc; Korthikanti et al. 2022);
    moe_layer=False: a dense layer of an MoE model (DeepSeek-V3's first layers: 6*ffn, no M).
    Multi-latent attention replaces 4ad + 4gd by its own terms (megarl/planner/mla.py)."""
    m, tp = cfg.model, cfg.parallel.tp
    h, a, g, d = arch.hidden, arch.heads, arch.kv_heads, arch.head_dim
    moe_layer = moe_layer and bool(arch.num_experts)
    f = arch.shared_ffn if moe_layer else arch.ffn
    replicated, attention = 8.0 * h, 4.0 * a * d + 4.0 * g * d
    if arch.mla is not None:
        latents, attention = arch.mla.activation_bytes(a)
        replicated += latents
    mixer = attention + core_attention_bytes_per_token(arch, cfg, seq_len)
    if arch.gdn is not None:  # hybrid: the mean over gated attention (+ gate and gated output 4ad) and delta-net layers
        mixer = (arch.attention_layers * (mixer + 4.0 * a * d) + arch.gdn.layers * arch.gdn.activation_bytes()) / arch.layers
    sharded = mixer + 6.0 * f
    moe = moe_bytes_per_local_token(arch, cfg, moe_imbalance) if moe_layer else 0.0
    if m.sequence_parallel:
        return (replicated + sharded + moe) / tp
    return replicated + sharded / tp + moe


def cp_kv_exchange_bytes(arch: Arch, cfg: MegaRLConfig, tokens: int) -> tuple[float, float]:
    """(kept per layer, transient) bytes of the K/V exchanged over the CP group, on one GPU, for a
    micro-batch of ``tokens`` tokens (all CP ranks together); (0, 0) at CP = 1.

    megarl's local attention all-gathers every layer's K and V: full-sequence K and V of the
    local KV heads, 2 * tokens * (g/TP) * d * bytes, kept for the backward by the blockwise path;
    the varlen path keeps its chunks' prefix keys, (2CP+1)/(2CP) times that, and the gathered
    copy is transient (with selective recompute nothing is kept: one layer's worth, transient).
    TE (model.cp_comm_type p2p, or a2a: re-sharded the same way) keeps about two K/V chunks in
    flight during a layer, 2 * 2 * (tokens/CP) * (g/TP) * d * bytes, transient (TE's other CP
    communication types refuse packed batches, and megarl's config refuses them).
    """
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return 0.0, 0.0
    element = 4 if m.dtype == "fp32" else 2
    kv_heads = arch.kv_heads / p.tp
    if m.transformer_impl == "local":
        full = 2.0 * tokens * kv_heads * arch.head_dim * element
        if not local_varlen(cfg):
            return (0.0, full) if m.recompute == "selective" else (full, 0.0)
        prefixes = full * (2 * p.cp + 1) / (2 * p.cp)
        return (0.0, full + prefixes) if m.recompute == "selective" else (prefixes, full)
    return 0.0, 2.0 * 2.0 * tokens / p.cp * kv_heads * arch.head_dim * element


def attention_workspace_bytes(arch: Arch, cfg: MegaRLConfig, row_tokens: float, seq_len: float) -> float:
    """Transient bytes of megarl's local attention for one query block: float32 scores,
    probabilities, dP and dS (4 x 4 bytes) of `block` queries x seq_len keys x a/TP heads, where the
    attention picks (megarl.models.attention_blockwise.query_block_size) block = clamp(min(
    LOCAL_SCORE_BLOCK_BYTES / (4 * a/TP * span), max(64, seq_len)), 16, 512) with the key span
    min(row_tokens, seq_len + 512) at CP 1, min(row_tokens, 2 * seq_len + 512 * CP) under CP;
    flash / fused kernels (the varlen path included) keep theirs in on-chip memory (0)."""
    if cfg.model.transformer_impl != "local" or local_varlen(cfg):
        return 0.0
    heads = arch.heads / cfg.parallel.tp
    cp = cfg.parallel.cp
    span = min(row_tokens, (1 if cp == 1 else 2) * seq_len + 512 * cp)
    block = max(16, min(512, max(64, int(seq_len)), LOCAL_SCORE_BLOCK_BYTES // int(4 * heads * max(1, span))))
    return 16.0 * heads * block * seq_len


def logits_bytes(arch: Arch, cfg: MegaRLConfig, tokens_per_gpu: float) -> float:
    """Log-prob / entropy buffers on the last stage: the bf16 logits [s, V/TP] and their bf16
    gradient (4 bytes per entry), plus one chunk of model.logprob_chunk_tokens tokens in float32
    (the logits, the softmax the cross entropy keeps, their gradient: 12 bytes per entry), never
    float32 logits of the whole micro-batch."""
    vocab = arch.vocab / cfg.parallel.tp
    chunk = min(cfg.model.logprob_chunk_tokens, tokens_per_gpu)
    return tokens_per_gpu * vocab * 4.0 + chunk * vocab * 12.0


def vision_bytes_per_patch(arch: Arch, cfg: MegaRLConfig) -> float:
    """Bytes the vision tower keeps for the backward per patch (module doc; 0 for a text model)."""
    v, tp = arch.vision, cfg.parallel.tp
    if v is None:
        return 0.0
    c = v.hidden
    block = 8.0 * c + (8.0 * c + (6.0 if v.gated_mlp else 4.0) * v.ffn + 4.0 * v.heads) / tp
    mergers = (1 + v.deepstack) * (4.0 * c + 4.0 * c / tp)
    return v.depth * block + mergers + 2.0 * v.patch_dim


def activation_bytes(arch: Arch, cfg: MegaRLConfig, role: str, moe_imbalance: float = 1.0,
                     patches: int = 0) -> dict[str, float]:
    """Peak activation bytes on one GPU while training ``role`` (actor | critic); ``patches``:
    vision-tower patches in one micro-batch (vision-language models).

    Keys: layers (kept for the backward, x micro-batches in flight), kv_exchange (the CP K/V
    buffers, kept and transient), workspace (transient attention blocks), logits, moe_buffers
    (transient dispatcher + grouped GEMM buffers of one MoE layer), vision (the tower's, x the
    micro-batches in flight on the first stage), total.
    """
    p, m = cfg.parallel, cfg.model
    budget = getattr(cfg, role).max_tokens_per_microbatch
    s = budget / p.cp
    seq_len = min(budget, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    kv_kept, kv_transient = cp_kv_exchange_bytes(arch, cfg, budget)
    per_layer = s * activation_bytes_per_token_layer(arch, cfg, seq_len, moe_imbalance)
    dense_layers, moe_layers = arch.stage_layers(p.pp, p.pp - 1)  # the stage with the most MoE layers
    per_dense = s * activation_bytes_per_token_layer(arch, cfg, seq_len, moe_imbalance, moe_layer=False)
    layers = dense_layers + moe_layers
    if m.recompute == "full":  # chunk inputs kept, whole layers only for the chunk being recomputed
        chunk_input = s * 2.0 * arch.hidden / (p.tp if m.sequence_parallel else 1)
        k = min(m.recompute_num_layers, layers)
        if m.recompute_method == "uniform":
            inputs, full_layers = math.ceil(layers / k) * chunk_input, k
        else:  # block: the first k layers of the stage are recomputed (one at a time), the rest keep activations
            inputs, full_layers = k * chunk_input, layers - k + 1
    else:
        inputs, full_layers = 0.0, layers
    inflight = p.pp * (1 + (p.pp - 1) / (p.pp * p.vpp)) if p.vpp else p.pp
    if m.recompute == "full":  # the layers recomputed at a time: as an MoE layer (the larger)
        layer_acts = (inputs + full_layers * max(per_layer, per_dense)) * inflight
    else:
        layer_acts = (inputs + dense_layers * per_dense + moe_layers * per_layer) * inflight
    kv_exchange = full_layers * kv_kept * inflight + kv_transient
    workspace = attention_workspace_bytes(arch, cfg, budget, seq_len)
    logits = 0.0 if role == "critic" else logits_bytes(arch, cfg, s)
    moe_buffers = moe_buffer_bytes(arch, cfg, s / p.tp if m.sequence_parallel else s, moe_imbalance)
    vision = patches * vision_bytes_per_patch(arch, cfg) * inflight
    return {"layers": layer_acts, "kv_exchange": kv_exchange, "workspace": workspace, "logits": logits,
            "moe_buffers": moe_buffers, "vision": vision, "patches": patches,
            "total": layer_acts + kv_exchange + workspace + logits + moe_buffers + vision}


TERM_ADVICE = {
    "model states": "shard them further (parallel.tp / parallel.pp, more nodes for the distributed optimizer over "
                    "DP x CP) or offload the optimizer (actor/critic.offload_optimizer)",
    "layer activations": "split each sequence over more GPUs (parallel.cp: tokens per GPU = max_tokens_per_microbatch "
                         "/ cp), recompute more (model.recompute=full) or use sequence parallelism",
    "CP K/V exchange": "use model.recompute=selective (the gathered K/V are not kept) or Transformer Engine's ring "
                       "attention (model.transformer_impl=transformer_engine)",
    "attention workspace": "use Transformer Engine's fused attention (model.transformer_impl=transformer_engine) or "
                           "raise parallel.tp",
    "logits": "lower model.logprob_chunk_tokens, raise parallel.cp or parallel.tp",
    "MoE buffers": "lower max_tokens_per_microbatch or raise parallel.cp / parallel.tp (fewer tokens routed per GPU)",
    "vision tower": "fewer or smaller images per micro-batch (lower max_tokens_per_microbatch, data.max_image_tokens) "
                    "or raise parallel.tp (the tower's attention and MLP split over TP)",
}


def train_overflow_message(cfg: MegaRLConfig, states: list["ModelState"], acts: dict[str, dict[str, float]],
                           peak: float, at_step: bool, cap: float, reserve: float) -> str:
    """Why the train phase does not fit: its terms, the largest named with what shrinks it."""
    resident = sum(s.resident for s in states)
    if at_step:
        terms = {"model states": peak - reserve}
        detail = f"model states during the optimizer step {(peak - reserve) / GIB:.1f}"
    else:
        worst = max(acts, key=lambda k: acts[k]["total"])
        a = acts[worst]
        tokens = getattr(cfg, worst).max_tokens_per_microbatch / cfg.parallel.cp
        terms = {"model states": resident, "layer activations": a["layers"], "CP K/V exchange": a["kv_exchange"],
                 "attention workspace": a["workspace"], "logits": a["logits"], "MoE buffers": a["moe_buffers"],
                 "vision tower": a.get("vision", 0.0)}
        detail = (f"model states {resident / GIB:.1f} + {worst} activations at {tokens:,.0f} tokens per GPU: layers "
                  f"{a['layers'] / GIB:.1f}, CP K/V exchange {a['kv_exchange'] / GIB:.1f}, attention workspace "
                  f"{a['workspace'] / GIB:.1f}, logits {a['logits'] / GIB:.1f}, MoE buffers {a['moe_buffers'] / GIB:.1f}"
                  + (f", vision tower {a['vision'] / GIB:.1f} ({a['patches']:,} patches)" if a.get("vision") else ""))
    top = max(terms, key=terms.get)
    return (f"train phase needs {peak / GIB:.1f} GiB > {cap / GIB:.1f} GiB ({detail}, reserve {reserve / GIB:.1f}); "
            f"the largest term is {top} ({terms[top] / GIB:.1f} GiB): {TERM_ADVICE[top]}")
