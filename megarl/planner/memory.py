"""The planner's phases: the model states of a layout, the rollout and train peaks against a GPU,
and the step-time model (megarl/planner/__init__.py states both models)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.config import ConfigError, MegaRLConfig, validate_model, validate_world
from megarl.planner.activations import activation_bytes, train_overflow_message
from megarl.planner import engine
from megarl.planner.arch import GIB, GPU, MOE_IMBALANCE, Arch, ModelState, lm_config
from megarl.planner.engine import EngineShape
from megarl.planner.rollout_data import rollout_data
from megarl.planner.vision import Images, image_load, microbatch_patches, vision_problems

def stream_transient_bytes(bucket: float, tp: int, pp: int) -> float:
    """What the weight stream allocates for one bucket of `bucket` bytes on its owning stage
    (megarl.weights.stream.StreamStats.peak_bytes): with TP > 1 this rank's packed shards
    (bucket / TP), the gathered shards (bucket) and the merged HF tensors (bucket); at TP = 1 the
    merged copies only; with PP > 1 also the broadcast buffer (bucket). Routed experts travel in
    buffers of at most a bucket too (megarl.weights.expert_delivery)."""
    return bucket * ((2.0 + 1.0 / tp if tp > 1 else 1.0) + (1.0 if pp > 1 else 0.0))


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
        # gradients: DDP's buffer in float32 (megarl.trainer.train_model: grad_reduce_in_fp32)
        out.append(ModelState(role, n, wbytes * n, 4.0 * trained, opt, o.offload_optimizer))
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
    rollout_data: dict[str, float] = field(default_factory=dict)  # per-rank bytes (megarl.planner.rollout_data)
    sync_peak: float = 0.0  # the weight sync: training state kept + engine weights + stream buffers + reserve
    sync_stream: float = 0.0

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
    shape = EngineShape.of(cfg)
    engine_weights = engine.weight_bytes(arch, shape)
    kv_pool = engine_share - engine_weights
    kv_tokens = engine.kv_tokens(arch, shape, kv_pool)
    resident_rollout = 0.0 if r.offload_train_state else sum(s.resident for s in states)
    rollout_peak = resident_rollout + engine_share + reserve
    longest = cfg.data.max_prompt_len + r.max_new_tokens
    if engine_weights >= engine_share:
        fp8 = arch.fp8 or r.weights_dtype == "fp8"
        fmt = "block-FP8" if fp8 else "bf16"
        bigger = "" if fp8 else ", serve FP8 weights: rollout.weights_dtype=fp8 (half the bytes)"
        problems.append(
            f"rollout: one engine's {fmt} weights need {engine_weights / GIB:.1f} GiB per GPU at rollout_tp="
            f"{p.rollout_tp}" + (f" (attention on {shape.attn_tp} GPUs: rollout.sglang_dp_size={shape.dp})"
                                 if shape.dp > 1 else "")
            + f", more than its share rollout.mem_fraction x capacity = {engine_share / GIB:.1f} GiB, "
            f"leaving no KV cache; raise parallel.rollout_tp (whole nodes with rollout.engine=sglang){bigger}, "
            "or use GPUs with more memory")
    elif kv_tokens < (longest + arch.state_tokens(shape.attn_tp)) * shape.dp:  # hybrid: + a sequence's recurrent state
        problems.append(f"rollout: the engine's KV cache holds {kv_tokens / shape.dp:,.0f} tokens per attention group, "
                        f"less than one longest sequence ({longest:,}); raise rollout.mem_fraction or "
                        "parallel.rollout_tp, or lower rollout.sglang_dp_size")
    if rollout_peak > cap:
        problems.append(f"rollout phase needs {rollout_peak / GIB:.1f} GiB > {cap / GIB:.1f} GiB "
                        f"(engine {engine_share / GIB:.1f} + resident training state {resident_rollout / GIB:.1f} "
                        f"+ reserve {reserve / GIB:.1f}); lower rollout.mem_fraction or offload the training state")

    # sync phase: the actor's weights stream into the engine's weights (taken back before the stream)
    sync_resident = (0.0 if r.sync_from_host else states[0].weights) if r.offload_train_state else \
        sum(s.resident for s in states)
    sync_stream = stream_transient_bytes(r.weight_bucket_mb * 2**20, p.tp, p.pp) + (
        r.weight_bucket_mb * 2**20 if r.engine == "sglang" else 0.0)  # SGLang flattens each bucket once more
    sync_peak = sync_resident + engine_weights + sync_stream + reserve
    if sync_peak > cap:
        problems.append(f"weight sync needs {sync_peak / GIB:.1f} GiB > {cap / GIB:.1f} GiB (training state kept "
                        f"{sync_resident / GIB:.1f} + engine weights {engine_weights / GIB:.1f} + stream buffers "
                        f"{sync_stream / GIB:.1f} + reserve {reserve / GIB:.1f}); set rollout.sync_from_host=true "
                        "(and rollout.offload_train_state=true), lower rollout.weight_bucket_mb, or raise parallel.rollout_tp")

    # train phase: all model states resident, activations of the model being trained
    resident = sum(s.resident for s in states)
    fwd_bwd = resident + max((a["total"] for a in acts.values()), default=0.0)
    step = max(resident - s.resident + s.at_step for s in states)  # one model's optimizer step at a time
    train_peak = max(fwd_bwd, step) + reserve
    if train_peak > cap:
        problems.append(train_overflow_message(cfg, states, acts, train_peak, step > fwd_bwd, cap, reserve))

    out = Plan(arch, gpu, world, dp, arch.total_params(), states, acts, engine_share, engine_weights, kv_pool,
               kv_tokens, rollout_peak, train_peak, reserve, images, problems, sync_peak=sync_peak,
               sync_stream=sync_stream)
    out.time = step_time(cfg, arch, gpu, world, kv_tokens, avg_prompt_len, avg_response_len, mfu, decode_eff, gen_rounds,
                         images)
    out.time["host_s"] = host_transfer_s(cfg, states)
    out.time["step_s"] += out.time["host_s"]
    out.rollout_data = rollout_data(cfg, arch, world, *mean_lengths(cfg, avg_prompt_len, avg_response_len, images),
                                    images, gen_rounds)
    return out


PCIE_BYTES_PER_S = 25e9  # host <-> GPU, per GPU, pinned copies (PCIe Gen5 x16 with 8 GPUs sharing a host)


def host_transfer_s(cfg: MegaRLConfig, states: list[ModelState]) -> float:
    """Seconds a step spends copying between GPU and host memory at PCIE_BYTES_PER_S:
    rollout.offload_train_state moves every model's resident state off the GPU and back (2 x
    resident bytes), and an offloaded optimizer (offload_optimizer) receives the float32
    gradients and returns the bf16 weights at every update (6 bytes per parameter held, samples /
    mini_batch_size x ppo_epochs updates per step). The host's Adam step itself is not counted."""
    a, r = cfg.algorithm, cfg.rollout
    moved = 2.0 * sum(s.resident for s in states) if r.offload_train_state else 0.0
    updates = max(1, r.prompts_per_step * r.n_samples_per_prompt // max(a.mini_batch_size, 1)) * a.ppo_epochs
    moved += sum(6.0 * s.params_gpu * updates for s in states if s.offload_optimizer)
    return moved / PCIE_BYTES_PER_S


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
    attn_fwd_per_token = 2.0 * arch.attention_layers * arch.heads * (arch.head_dim + arch.value_dim) * (seq / 2)

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
    # pipeline bubble of 1F1B: (pp - 1) / (micro-batches per mini-batch x vpp) idle on top of the work
    dp = max(1, world // (p.tp * p.pp * p.cp))
    microbatches = max(1, math.ceil(a.mini_batch_size * seq / dp / max(cfg.actor.max_tokens_per_microbatch, 1)))
    bubble = (p.pp - 1) / (microbatches * (p.vpp or 1))
    train_s = flops / (world * gpu.bf16_flops * mfu) * (1.0 + bubble)

    engines = world // p.rollout_tp
    gen_prompts = (r.gen_batch_prompts or r.prompts_per_step) * gen_rounds
    seqs_per_engine = math.ceil(gen_prompts * r.n_samples_per_prompt / max(engines, 1))
    concurrent = max(1, min(seqs_per_engine, int(kv_tokens // (seq + arch.state_tokens(EngineShape.of(cfg).attn_tp)))))
    steps = max(gen_cap, math.ceil(seqs_per_engine * resp / concurrent))
    # the mean batch of a step: all sequences at once finish before the longest, so when the
    # longest response sets the steps the batch averages below the KV cache's capacity
    batch = seqs_per_engine * resp / steps
    decode = engine.decode_step(arch, EngineShape.of(cfg), gpu, batch, seq / 2, decode_eff)
    decode_step = decode["step_s"]
    prefill_s = ((2.0 * n_actor * prompt + tower) * gen_prompts * r.n_samples_per_prompt
                 / (world * gpu.bf16_flops * mfu))
    rollout_s = steps * decode_step + prefill_s
    return {"avg_prompt_len": prompt, "avg_response_len": resp, "train_tokens": tokens, "train_flops": flops,
            "vision_flops_per_sample": tower,
            "train_s": train_s, "pp_bubble": bubble, "concurrent_seqs_per_engine": concurrent, "mean_decode_batch": batch, "seqs_per_engine": seqs_per_engine,
            "decode_steps": steps, "decode_step_s": decode_step, "decode_comm_s": decode["comm_s"], "rollout_s": rollout_s,
            "step_s": train_s + rollout_s, "mfu": mfu}


# ----------------------------------------------------------------------------- report


