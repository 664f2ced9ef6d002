#!/usr/bin/env python
"""Plan a megarl run: per-GPU memory in the rollout and train phases, and a step-time estimate.

    python tools/plan.py --recipe configs/recipes/qwen2.5-32b/dapo.yaml \
        --layout configs/layouts/qwen2.5-32b/16node.yaml --nodes 16 --gpu h100

Memory model (bytes per GPU; P_gpu = parameters held by the GPU's TP x PP shard, from the HF
config: embedding and output layer counted on the first / last pipeline stage, vocab-parallel
over TP; norms replicated; the largest stage is reported):
  weights    2 * P_gpu (bf16; 4 for fp32)                    actor, critic, reference (kl_coef > 0)
  grads      2 * P_gpu (megatron DDP grad buffer in the param dtype)         actor, critic
  optimizer  12 * P_gpu / (DP * CP) with the distributed optimizer (fp32 master + Adam m, v),
             12 * P_gpu without it                                           actor, critic
Mixture of experts (qwen3_moe, qwen2_moe): P_gpu = P_dense + P_expert, where P_dense is the
  above without the routed experts (the router E x h and the shared expert gate replicated over
  TP, the shared expert TP-sharded) and P_expert = layers_per_stage * E * 3*h*f_e / (EP * ETP)
  (every GPU holds E/EP experts, each split over expert-TP; ETP = parallel.etp or tp). The
  distributed optimizer shards P_dense over DP x CP = world / (TP * PP) and P_expert over the
  expert-data-parallel group, EDP = world / (ETP * EP * PP):
  optimizer  12 * P_dense / (DP * CP) + 12 * P_expert / EDP.
  MoE activations, dispatcher (alltoall) and grouped GEMM buffers: tools/plan_activations.py.
Vision-language models (qwen2_5_vl, qwen3_vl, qwen3_vl_moe; the LM's fields from text_config or
  the top level, an MoE LM as above; tools/plan_vision.py): the vision tower (VisionTower) sits on the first pipeline
  stage with its linears split over TP as megarl shards them (norms, patch embedding, position
  table and row-parallel biases replicated): P_gpu += P_vision_sharded / TP + P_vision_replicated
  for the actor, the critic (a vision-language critic keeps the tower) and the reference; its
  Adam state shards over DP x CP like any dense parameter. With model.freeze_vision the tower
  has weights only (no grads, no optimizer state). Images (stated assumptions:
  --images-per-sample, --image-pixels or --image-tokens, --images-per-microbatch): an image is
  T LM tokens (a square image of that many pixels with sides rounded by smart_resize to multiples
  of p * m, T = (side / (p*m))^2) and T * m^2 tower patches; a prompt's image tokens count in
  data.max_prompt_len (so the longest sequence is still max_prompt_len + max_new_tokens) and in
  the mean prompt; a micro-batch holds the images of floor(max_tokens_per_microbatch / mean
  sample length) samples unless --images-per-microbatch says otherwise; the tower's activations
  for them: tools/plan_activations.py.
  activations, CP K/V exchange, attention workspace and logits of the model being trained: see
             tools/plan_activations.py (per micro-batch of max_tokens_per_microbatch / CP tokens per GPU).
  rollout    the engine reserves rollout.mem_fraction of the GPU for its weights
             (2 * P_total / rollout_tp, vision tower included) and KV cache (2 * layers * kv_heads
             * head_dim * 2 bytes per token, / rollout_tp); colocated, the training state is offloaded during rollout
             when rollout.offload_train_state is true.
  reserve    --reserve-gib (CUDA contexts of trainer and engine, NCCL buffers, fragmentation).
Phases: rollout = resident training state + engine share + reserve;
        train   = all resident model states + the larger of actor / critic activations + reserve
        (with offload_optimizer a model's optimizer state comes back only for its own step, when no
        activations are held).
The GPU is --gpu (default h100; capacities as nvidia-smi reports them: GPUS). A phase over capacity
is reported with its terms; the train phase names its largest term and the settings that shrink it.

Time model (stated assumptions: --avg-prompt-len, --avg-response-len, --mfu, --decode-eff):
  training FLOPs = 6*N*T per epoch for actor and critic, 2*N*T per forward-only pass (old
  log-probs, reference, values; N = the parameters a token passes through, for an MoE model its
  active parameters: k of the E routed experts), plus causal attention 4*L*a*d*c per token forward (c = mean
  context), x3 for forward + backward (x4 with full recompute); time = FLOPs / (GPUs * peak * MFU).
  A vision-language model adds its images' tower FLOPs per sample (VisionTower.forward_flops:
  2 per weight per patch or merged token, non-causal attention 4 * patches * ctx * c per block)
  x (1 + 3 * epochs) for actor and critic (the tower is never recomputed), once for the reference
  and once in the rollout's prefill (2*N*prompt per sample there, image tokens included).
  decode: per engine step time = max((weight bytes + KV bytes read) / (HBM bw * eff),
  2*N*batch / (rollout_tp * peak * eff)), weight bytes = all LM parameters (a decode batch of
  hundreds of tokens routes to nearly every expert; the vision tower is not read); steps =
  max(longest response, tokens per engine / concurrent sequences the KV cache holds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from megarl.config import ConfigError, MegaRLConfig, load_config, validate_model, validate_world  # noqa: E402
from plan_activations import (  # noqa: E402,F401  (the memory model's parts, re-exported for tests)
    activation_bytes, activation_bytes_per_token_layer, attention_workspace_bytes, cp_kv_exchange_bytes,
    logits_bytes, train_overflow_message, vision_bytes_per_patch)
from plan_vision import (  # noqa: E402,F401  (the vision tower's accounting, re-exported for tests)
    DEFAULT_IMAGE_PIXELS, VISION_DEFAULTS, Images, VisionTower, image_load, microbatch_patches, vision_problems)

GIB = 1024**3
MOE_IMBALANCE = 2.0  # the busiest EP rank receives 2x the mean routed tokens (RL: no load-balancing loss)


@dataclass(frozen=True)
class GPU:
    name: str
    mem_bytes: int  # as nvidia-smi reports the total
    bf16_flops: float  # dense peak
    hbm_bytes_per_s: float


GPUS = {
    "h100": GPU("H100 SXM 80GB", 81559 * 1024**2, 989e12, 3.35e12),
    "h200": GPU("H200 SXM 141GB", 143771 * 1024**2, 989e12, 4.8e12),
}


# vision-language model_type -> the family of its language model (text_config)
VLM_TEXT_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}

def lm_config(hf: dict) -> dict:
    """The language model's fields of an HF config.json: a vision-language config keeps them in
    text_config (Qwen3-VL; transformers 5 saves) or at the top level (Qwen2.5-VL hub files);
    text_config wins, the top level fills the rest (vision_config, token ids)."""
    return {**hf, **(hf.get("text_config") or {})}


@dataclass(frozen=True)
class Arch:
    """Decoder architecture read from an HF config.json: dense, or MoE when num_experts > 0 (every
    layer's MLP = router + num_experts routed experts of moe_ffn, moe_topk per token, + an
    optional shared expert of shared_ffn with a sigmoid gate, as Qwen2-MoE); a vision-language
    config (qwen2_5_vl, qwen3_vl, qwen3_vl_moe) adds its vision tower (`VisionTower`) and keeps
    the LM's fields in text_config or at its top level (`lm_config`)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    vision: VisionTower | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> "Arch":
        model_type = hf.get("model_type", "")
        family = VLM_TEXT_FAMILY.get(model_type, model_type)
        if hf.get("vision_config") is not None and model_type not in VLM_TEXT_FAMILY:
            raise ConfigError(f"planner: vision-language model_type {model_type!r} is not modelled "
                              f"({', '.join(VLM_TEXT_FAMILY)} are)")
        t = lm_config(hf)
        if any(t.get(k) for k in ("num_local_experts", "n_routed_experts")) or (
                t.get("num_experts") and family not in ("qwen3_moe", "qwen2_moe")):
            raise ConfigError(f"planner: MoE model_type {model_type!r} is not modelled "
                              "(qwen3_moe, qwen2_moe and qwen3_vl_moe are)")
        heads = t["num_attention_heads"]
        experts = int(t.get("num_experts") or 0)
        # HF's Qwen2 attention (Qwen2.5-VL's LM too) ignores head_dim: hidden / heads
        head_dim = (None if family == "qwen2" else t.get("head_dim")) or t["hidden_size"] // heads
        tie = hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        return cls(
            hidden=t["hidden_size"],
            layers=t["num_hidden_layers"],
            heads=heads,
            kv_heads=t.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn=t["intermediate_size"],
            vocab=t["vocab_size"],
            tie_embeddings=bool(tie),
            qkv_bias=bool(t.get("attention_bias", family in ("qwen2", "qwen2_moe"))),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_topk=int(t.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(t.get("moe_intermediate_size") or 0) if experts else 0,
            shared_ffn=int(t.get("shared_expert_intermediate_size") or 0) if experts else 0,
            vision=VisionTower.from_hf(hf) if model_type in VLM_TEXT_FAMILY else None,
        )

    def _attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias)."""
        h, a, g, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        attn = h * a * d + 2 * h * g * d + a * d * h
        return attn + (a * d + 2 * g * d if self.qkv_bias else 0)

    def _replicated_layer_params(self) -> int:
        """Per layer, replicated over TP: two norms (2h), q/k norms (2d), MoE router (E*h) and
        shared expert gate (h)."""
        out = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.num_experts:
            out += self.num_experts * self.hidden + (self.hidden if self.shared_ffn else 0)
        return out

    def expert_layer_params(self) -> int:
        """Routed experts of one layer: E gated MLPs (gate, up, down) of moe_ffn, E * 3*h*f_e."""
        return self.num_experts * 3 * self.hidden * self.moe_ffn

    def layer_params(self) -> int:
        """Attention, norms and the MLP: gated (3*h*f) when dense; router, routed experts and the
        shared expert (3*h*f_s) when MoE."""
        mlp = 3 * self.hidden * (self.shared_ffn if self.num_experts else self.ffn)
        return self._attention_params() + mlp + self.expert_layer_params() + self._replicated_layer_params()

    def lm_params(self, value_head: bool = False) -> int:
        """The language model's parameters; a critic replaces the LM head with a scalar value head (h + 1)."""
        emb = self.vocab * self.hidden
        head = (self.hidden + 1) if value_head else (0 if self.tie_embeddings else emb)
        return emb + self.layers * self.layer_params() + self.hidden + head

    def total_params(self, value_head: bool = False) -> int:
        """All parameters: the language model and the vision tower (a vision-language critic keeps it)."""
        return self.lm_params(value_head) + (self.vision.total_params() if self.vision else 0)

    def active_params(self, value_head: bool = False) -> int:
        """Parameters one LM token passes through: the language model's less the routed experts it
        is not sent to, layers * (E - k) * 3*h*f_e (= lm_params for a dense model); the tower's
        work is per patch (VisionTower.forward_flops)."""
        idle = self.layers * (self.num_experts - self.moe_topk) * 3 * self.hidden * self.moe_ffn
        return self.lm_params(value_head) - idle

    def stage_expert_params(self, pp: int, ep: int = 1, etp: int = 1) -> int:
        """Routed-expert parameters on one GPU: layers_per_stage * E * 3*h*f_e / (EP * ETP)."""
        return math.ceil(self.layers / pp) * self.expert_layer_params() // (ep * etp)

    def stage_vision_params(self, tp: int) -> int:
        """Vision-tower parameters on one GPU of the first stage (0 for a text model)."""
        return int(math.ceil(self.vision.stage_params(tp))) if self.vision else 0

    def stage_params(self, tp: int, pp: int, value_head: bool = False, ep: int = 1, etp: int | None = None,
                     vision: bool = True) -> int:
        """Parameters on one GPU of the largest pipeline stage (TP-sharded; norms, router
        replicated; routed experts over EP x ETP, ETP = etp or tp; the vision tower on the first
        stage, `VisionTower.stage_params`, unless vision=False: a frozen tower's untrained part)."""
        layers_per_stage = math.ceil(self.layers / pp)
        replicated = self._replicated_layer_params()
        sharded_layer = (self.layer_params() - replicated - self.expert_layer_params()) / tp
        per_layer = sharded_layer + replicated
        emb = self.vocab * self.hidden / tp
        head = (self.hidden + 1) if value_head else (emb if (not self.tie_embeddings or pp > 1) else 0)
        first = (emb + (self.stage_vision_params(tp) if vision else 0) + layers_per_stage * per_layer
                 + (head + self.hidden if pp == 1 else 0))
        last = layers_per_stage * per_layer + self.hidden + head + (emb if pp == 1 else 0)
        dense = int(math.ceil(max(first, last) if pp > 1 else first))
        return dense + self.stage_expert_params(pp, ep, etp or tp)

    def kv_bytes_per_token(self, rollout_tp: int) -> float:
        """KV cache per token on one engine GPU: 2 (K, V) * layers * kv_heads * head_dim * 2 bytes
        / rollout_tp (KV heads are replicated when rollout_tp > kv_heads)."""
        heads_per_gpu = self.kv_heads / rollout_tp if self.kv_heads >= rollout_tp else 1
        return 2 * self.layers * heads_per_gpu * self.head_dim * 2


def load_arch(cfg: MegaRLConfig, model_json: str | None = None) -> tuple[Arch, dict, str]:
    """The HF config: --model-json, else hf_path/config.json, else configs/models/<model.name>.json."""
    candidates = [model_json] if model_json else []
    if cfg.model.hf_path:
        candidates.append(os.path.join(cfg.model.hf_path, "config.json"))
    if cfg.model.name:
        candidates.append(os.path.join(REPO, "configs", "models", f"{cfg.model.name}.json"))
    for path in candidates:
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
            return Arch.from_hf(hf), hf, path
    raise ConfigError(f"planner: no model config found (tried {candidates or 'nothing'}); pass --model-json "
                      "or set model.name / model.hf_path")


# ----------------------------------------------------------------------------- memory


@dataclass
class ModelState:
    role: str
    params_gpu: int
    weights: float
    grads: float
    optimizer: float
    offload_optimizer: bool

    @property
    def resident(self) -> float:
        """Bytes on the GPU during forward / backward."""
        return self.weights + self.grads + (0.0 if self.offload_optimizer else self.optimizer)

    @property
    def at_step(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_states(arch: Arch, cfg: MegaRLConfig, world: int) -> list[ModelState]:
    p = cfg.parallel
    etp = p.etp or p.tp
    dp_cp = world // (p.tp * p.pp)  # the distributed optimizer shards over DP x CP
    edp = max(1, world // (etp * p.ep * p.pp))  # ... and expert parameters over expert-DP
    wbytes = 4 if cfg.model.dtype == "fp32" else 2
    # model.freeze_vision: the tower gets no gradient and no optimizer state (getattr: older schemas lack it)
    frozen = bool(getattr(cfg.model, "freeze_vision", False))
    out = []
    roles = [("actor", False)] + ([("critic", True)] if cfg.critic.enable else [])
    for role, value_head in roles:
        o = getattr(cfg, role)
        n = arch.stage_params(p.tp, p.pp, value_head, p.ep, etp)
        experts = arch.stage_expert_params(p.pp, p.ep, etp)
        trained = arch.stage_params(p.tp, p.pp, value_head, p.ep, etp, vision=not frozen)
        if o.use_distributed_optimizer:
            opt = 12.0 * (trained - experts) / dp_cp + 12.0 * experts / edp
        else:
            opt = 12.0 * trained
        out.append(ModelState(role, n, wbytes * n, wbytes * trained, opt, o.offload_optimizer))
    if cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_in_reward:
        n = arch.stage_params(p.tp, p.pp, False, p.ep, etp)
        out.append(ModelState("reference", n, wbytes * n, 0.0, 0.0, False))
    return out


@dataclass
class Plan:
    arch: Arch
    gpu: GPU
    world: int
    dp: int
    params_total: int
    states: list[ModelState]
    activations: dict[str, dict[str, float]]
    engine_share: float
    engine_weights: float
    kv_pool: float
    kv_tokens: float
    rollout_peak: float
    train_peak: float
    reserve: float
    images: Images | None = None
    problems: list[str] = field(default_factory=list)
    time: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems


def plan(cfg: MegaRLConfig, arch: Arch, hf: dict, gpu: GPU, reserve_gib: float = 6.0,
         avg_prompt_len: int | None = None, avg_response_len: int | None = None,
         mfu: float = 0.4, decode_eff: float = 0.6, gen_rounds: int = 1, moe_imbalance: float = MOE_IMBALANCE,
         images: Images | None = None) -> Plan:
    """The plan of `cfg` on `gpu`; a vision-language model without `images` gets image_load(arch)."""
    p, r = cfg.parallel, cfg.rollout
    world = p.nodes * p.gpus_per_node
    images = images or image_load(arch)
    problems: list[str] = vision_problems(arch, cfg, images)
    for check in (lambda: validate_world(cfg, world), lambda: validate_model(cfg, lm_config(hf))):
        try:
            check()
        except ConfigError as e:
            problems.extend(e.errors)
    dp = world // (p.tp * p.pp * p.cp) if world % (p.tp * p.pp * p.cp) == 0 else 0
    reserve = reserve_gib * GIB
    cap = gpu.mem_bytes
    states = model_states(arch, cfg, world)
    sample = sum(mean_lengths(cfg, avg_prompt_len, avg_response_len, images))
    acts = {s.role: activation_bytes(arch, cfg, s.role, moe_imbalance, microbatch_patches(cfg, s.role, images, sample))
            for s in states if s.role != "reference"}

    # rollout phase: engine share (static reservation) + whatever training state stays resident
    engine_share = r.mem_fraction * cap
    engine_weights = 2.0 * arch.total_params() / p.rollout_tp
    kv_pool = engine_share - engine_weights
    kv_tokens = max(kv_pool, 0.0) / arch.kv_bytes_per_token(p.rollout_tp)
    resident_rollout = 0.0 if r.offload_train_state else sum(s.resident for s in states)
    rollout_peak = resident_rollout + engine_share + reserve
    longest = cfg.data.max_prompt_len + r.max_new_tokens
    if kv_tokens < longest:
        problems.append(f"rollout: the engine's KV cache holds {kv_tokens:,.0f} tokens per GPU group, less than one "
                        f"longest sequence ({longest:,}); raise rollout.mem_fraction or parallel.rollout_tp")
    if rollout_peak > cap:
        problems.append(f"rollout phase needs {rollout_peak / GIB:.1f} GiB > {cap / GIB:.1f} GiB "
                        f"(engine {engine_share / GIB:.1f} + resident training state {resident_rollout / GIB:.1f} "
                        f"+ reserve {reserve / GIB:.1f}); lower rollout.mem_fraction or offload the training state")

    # train phase: all model states resident, activations of the model being trained
    resident = sum(s.resident for s in states)
    fwd_bwd = resident + max((a["total"] for a in acts.values()), default=0.0)
    step = max(resident - s.resident + s.at_step for s in states)  # one model's optimizer step at a time
    train_peak = max(fwd_bwd, step) + reserve
    if train_peak > cap:
        problems.append(train_overflow_message(cfg, states, acts, train_peak, step > fwd_bwd, cap, reserve))

    out = Plan(arch, gpu, world, dp, arch.total_params(), states, acts, engine_share, engine_weights, kv_pool,
               kv_tokens, rollout_peak, train_peak, reserve, images, problems)
    out.time = step_time(cfg, arch, gpu, world, kv_tokens, avg_prompt_len, avg_response_len, mfu, decode_eff, gen_rounds,
                         images)
    return out


def mean_lengths(cfg: MegaRLConfig, avg_prompt_len: int | None, avg_response_len: int | None,
                 images: Images | None = None) -> tuple[int, int]:
    """(mean prompt, mean response) tokens: --avg-prompt-len text tokens (default min(256,
    max_prompt_len)) plus the image tokens (per_sample x tokens; the prompt stays within
    data.max_prompt_len, which counts them), --avg-response-len (default max_new_tokens / 2,
    at most max_new_tokens)."""
    prompt = avg_prompt_len if avg_prompt_len is not None else min(256, cfg.data.max_prompt_len)
    if images is not None:
        prompt = min(prompt + images.sample_tokens, cfg.data.max_prompt_len)
    resp = avg_response_len if avg_response_len is not None else cfg.rollout.max_new_tokens // 2
    return prompt, min(resp, cfg.rollout.max_new_tokens)


# ----------------------------------------------------------------------------- time


def step_time(cfg: MegaRLConfig, arch: Arch, gpu: GPU, world: int, kv_tokens: float,
              avg_prompt_len: int | None, avg_response_len: int | None, mfu: float,
              decode_eff: float, gen_rounds: int, images: Images | None = None) -> dict[str, float]:
    r, a, p = cfg.rollout, cfg.algorithm, cfg.parallel
    prompt, resp = mean_lengths(cfg, avg_prompt_len, avg_response_len, images)
    gen_cap = r.max_new_tokens
    seq = prompt + resp
    n_actor = arch.active_params()  # FLOPs per token: the experts a token is routed to
    n_critic = arch.active_params(value_head=True)
    samples = r.prompts_per_step * r.n_samples_per_prompt
    tokens = samples * seq
    attn_fwd_per_token = 4.0 * arch.layers * arch.heads * arch.head_dim * (seq / 2)

    # the vision tower: forward FLOPs of a sample's images, never recomputed (3 passes to train)
    tower = images.per_sample * arch.vision.forward_flops(images.patches) if images and arch.vision else 0.0

    def fwd(n: float) -> float:
        return (2.0 * n + attn_fwd_per_token) * tokens

    train_passes = 4 if cfg.model.recompute == "full" else 3  # full recompute repeats the forward
    lm_passes, tower_passes = 1 + train_passes * a.ppo_epochs, 1 + 3 * a.ppo_epochs  # old log-probs + training
    flops = fwd(n_actor) * lm_passes + tower * samples * tower_passes
    if a.kl_coef > 0 or a.kl_in_reward:
        flops += fwd(n_actor) + tower * samples
    if cfg.critic.enable:
        flops += fwd(n_critic) * lm_passes + tower * samples * tower_passes
    train_s = flops / (world * gpu.bf16_flops * mfu)

    engines = world // p.rollout_tp
    gen_prompts = (r.gen_batch_prompts or r.prompts_per_step) * gen_rounds
    seqs_per_engine = math.ceil(gen_prompts * r.n_samples_per_prompt / max(engines, 1))
    concurrent = max(1, min(seqs_per_engine, int(kv_tokens // seq)))
    steps = max(gen_cap, math.ceil(seqs_per_engine * resp / concurrent))
    weight_bytes = 2.0 * arch.lm_params() / p.rollout_tp  # a decode batch touches nearly every expert (not the tower)
    kv_read = concurrent * (seq / 2) * arch.kv_bytes_per_token(p.rollout_tp)
    t_mem = (weight_bytes + kv_read) / (gpu.hbm_bytes_per_s * decode_eff)
    t_flops = 2.0 * n_actor * concurrent / (p.rollout_tp * gpu.bf16_flops * decode_eff)
    decode_step = max(t_mem, t_flops)
    prefill_s = ((2.0 * n_actor * prompt + tower) * gen_prompts * r.n_samples_per_prompt
                 / (world * gpu.bf16_flops * mfu))
    rollout_s = steps * decode_step + prefill_s
    return {"avg_prompt_len": prompt, "avg_response_len": resp, "train_tokens": tokens, "train_flops": flops,
            "vision_flops_per_sample": tower,
            "train_s": train_s, "concurrent_seqs_per_engine": concurrent, "seqs_per_engine": seqs_per_engine,
            "decode_steps": steps, "decode_step_s": decode_step, "rollout_s": rollout_s,
            "step_s": train_s + rollout_s, "mfu": mfu}


# ----------------------------------------------------------------------------- report


def format_plan(cfg: MegaRLConfig, pl: Plan, arch_src: str) -> str:
    p = cfg.parallel
    g = lambda b: f"{b / GIB:7.1f} GiB"  # noqa: E731
    v, im = pl.arch.vision, pl.images
    lines = [
        f"model {cfg.model.name or cfg.model.hf_path} ({pl.params_total / 1e9:.2f}B params"
        + (f": {pl.arch.lm_params() / 1e9:.2f}B LM + {v.total_params() / 1e9:.2f}B vision tower" if v else "")
        + (f", {pl.arch.active_params() / 1e9:.2f}B active: {pl.arch.num_experts} experts, top-{pl.arch.moe_topk}"
           if pl.arch.num_experts else "") + f", from {arch_src})",
        f"layout: {p.nodes} nodes x {p.gpus_per_node} {pl.gpu.name} = {pl.world} GPUs; tp={p.tp} pp={p.pp} cp={p.cp} "
        f"dp={pl.dp} vpp={p.vpp} sp={cfg.model.sequence_parallel} recompute={cfg.model.recompute} rollout_tp={p.rollout_tp}"
        + (f" ep={p.ep} etp={p.etp or p.tp} edp={max(1, pl.world // ((p.etp or p.tp) * p.ep * p.pp))}"
           if pl.arch.num_experts else ""),
    ]
    if v and im:
        lines.append(f"images: {im.per_sample} per sample x {im.tokens} tokens ({im.patches} tower patches); "
                     f"vision tower {v.depth} blocks x {v.hidden} wide on the first stage, "
                     f"{pl.arch.stage_vision_params(p.tp) / 1e9:.2f}B params/GPU"
                     + (" (frozen)" if getattr(cfg.model, "freeze_vision", False) else ""))
    lines += [
        "",
        "per-GPU memory",
    ]
    for s in pl.states:
        experts = pl.arch.stage_expert_params(p.pp, p.ep, p.etp or p.tp)
        lines.append(f"  {s.role:<9} params/GPU {s.params_gpu / 1e9:6.2f}B"
                     + (f" ({experts / 1e9:.2f}B routed experts)" if experts else "") + f"  weights {g(s.weights)}  grads {g(s.grads)}  "
                     f"optimizer {g(s.optimizer)}{' (offloaded)' if s.offload_optimizer else ''}")
    for role, a in pl.activations.items():
        budget = getattr(cfg, role).max_tokens_per_microbatch
        kv_mib = a["kv_exchange"] / 2**20
        moe = f", MoE dispatcher + grouped GEMM buffers {g(a['moe_buffers'])}" if pl.arch.num_experts else ""
        vis = (f", vision tower {g(a['vision'])} for {a['patches'] // im.patches} images = {a['patches']:,} patches"
               if v and im else "")
        lines.append(f"  {role:<9} activations {g(a['total'])} (layers {g(a['layers'])}, CP K/V {kv_mib:,.0f} MiB, "
                     f"attention workspace {g(a['workspace'])}, logits {g(a['logits'])}{moe}{vis}) at {budget} "
                     f"tokens/micro-batch = {budget // p.cp} per GPU")
    lines += [
        f"  engine    share {g(pl.engine_share)} (weights {g(pl.engine_weights)}, KV pool {g(max(pl.kv_pool, 0))} "
        f"= {pl.kv_tokens:,.0f} tokens)",
        f"  reserve   {g(pl.reserve)}",
        f"  rollout phase peak {g(pl.rollout_peak)}   train phase peak {g(pl.train_peak)}   capacity {g(pl.gpu.mem_bytes)}",
        "",
        f"step time (assumed mean prompt {pl.time['avg_prompt_len']}"
        + (f" incl. {im.sample_tokens} image tokens" if v and im else "")
        + f" / response {pl.time['avg_response_len']} tokens, MFU {pl.time['mfu']:.2f})",
        f"  rollout {pl.time['rollout_s'] / 60:6.1f} min  ({pl.time['decode_steps']:,} decode steps x "
        f"{pl.time['decode_step_s'] * 1e3:.1f} ms, {pl.time['concurrent_seqs_per_engine']} of "
        f"{pl.time['seqs_per_engine']} sequences concurrent per engine)",
        f"  train   {pl.time['train_s'] / 60:6.1f} min  ({pl.time['train_flops']:.3g} FLOPs over {pl.time['train_tokens']:,} tokens)",
        f"  step    {pl.time['step_s'] / 60:6.1f} min",
        "",
        "FITS" if pl.fits else "DOES NOT FIT:\n  " + "\n  ".join(pl.problems),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe YAML")
    ap.add_argument("--layout", action="append", default=[], help="layout YAML composed after the recipe")
    ap.add_argument("--nodes", type=int, help="override parallel.nodes")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--model-json", help="HF config.json of the model (default: hf_path or configs/models/<name>.json)")
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="per-GPU reserve for contexts, NCCL, fragmentation")
    ap.add_argument("--mfu", type=float, default=0.4, help="training model-FLOPs utilisation")
    ap.add_argument("--decode-eff", type=float, default=0.6, help="achieved fraction of HBM bandwidth / peak during decode")
    ap.add_argument("--avg-prompt-len", type=int, help="mean prompt tokens (default min(256, max_prompt_len))")
    ap.add_argument("--avg-response-len", type=int, help="mean response tokens (default max_new_tokens / 2)")
    ap.add_argument("--gen-rounds", type=int, default=1, help="dynamic-sampling generation rounds per step")
    ap.add_argument("--moe-imbalance", type=float, default=MOE_IMBALANCE,
                    help="MoE: routed tokens on the busiest EP rank over the mean (1 = perfectly balanced)")
    ap.add_argument("--images-per-sample", type=int, default=1, help="vision-language models: images per prompt")
    ap.add_argument("--image-pixels", type=int, default=DEFAULT_IMAGE_PIXELS,
                    help="vision-language models: pixels of each (square) image after the processor's resize")
    ap.add_argument("--image-tokens", type=int,
                    help="vision-language models: LM tokens per image (overrides --image-pixels)")
    ap.add_argument("--images-per-microbatch", type=int,
                    help="vision-language models: images in one training micro-batch (default: the samples a "
                         "micro-batch holds at the mean sample length x --images-per-sample)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides) + ([f"parallel.nodes={args.nodes}"] if args.nodes else [])
    try:
        cfg = load_config([args.recipe, *args.layout], overrides)
        arch, hf, src = load_arch(cfg, args.model_json)
        images = image_load(arch, args.images_per_sample, args.image_pixels, args.image_tokens, args.images_per_microbatch)
        pl = plan(cfg, arch, hf, GPUS[args.gpu], args.reserve_gib, args.avg_prompt_len, args.avg_response_len,
                  args.mfu, args.decode_eff, args.gen_rounds, args.moe_imbalance, images)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_plan(cfg, pl, os.path.relpath(src, os.getcwd())))
    return 0 if pl.fits else 1


if __name__ == "__main__":
    sys.exit(main())
