"""The typed config tree of megarl.

Every field is declared with :func:`doc_field`, which stores a default and a one-line doc in the
dataclass field metadata (``metadata["doc"]``). The loader uses the annotations for type checks and
the docs for error messages and ``megarl config --explain``.

To add a field: add one ``name: type = doc_field(default, "what it is")`` line to the right
dataclass. Allowed types: bool, int, float, str, ``Literal[...]``, ``X | None``, ``list[X]``,
``dict[str, X]``, ``Any`` and nested config dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megarl.config.fields import doc_field
from megarl.config.tools import ToolsConfig


LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3", "abs"]
DecayStyle = Literal["constant", "linear", "cosine"]


@dataclass
class ModelConfig:
    name: str | None = doc_field(
        None,
        "short model name (e.g. 'qwen2.5-32b'); the planner reads configs/models/<name>.json when "
        "hf_path/config.json is not on this machine",
    )
    hf_path: str | None = doc_field(None, "HF model directory (config.json + tokenizer; weights when load is null)")
    load: str | None = doc_field(
        None, "megatron torch_dist checkpoint dir of the actor; null = import weights from hf_path"
    )
    critic_load: str | None = doc_field(None, "megatron torch_dist checkpoint dir of the critic (e.g. a pretrained value model)")
    dtype: Literal["fp32", "bf16", "fp16"] = doc_field("bf16", "parameter / compute dtype of the trained models")
    attention_kernel: Literal["auto", "varlen", "sdpa", "blockwise"] = doc_field(
        "auto", "kernel of megarl's own core attention (transformer_impl=local): auto = torch's FlashAttention varlen "
        "on CUDA in bf16/fp16, SDPA on padded groups elsewhere at cp=1, blockwise under CP; a forced kernel that "
        "cannot run here fails at the first forward (blockwise: the reference, and the CPU kernel before 2026-11-27)")
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = doc_field(
        "auto", "megatron-core AttnBackend: which Transformer Engine attention kernels may run (sets NVTE_*_ATTN); "
        "'local' turns all three off, so it is refused unless transformer_impl=local, whose core attention is "
        "megarl's own (that one ignores this field)"
    )
    transformer_impl: Literal["local", "transformer_engine", "auto"] = doc_field(
        "auto", "layer spec: megatron local layers, Transformer Engine layers, or TE when importable"
    )
    fp8: Literal["e4m3", "hybrid"] | None = doc_field(None, "FP8 training format (TE only); null = bf16")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = doc_field(
        "delayed", "TE FP8 scaling recipe; on H100/H200 use delayed, tensorwise or blockwise"
    )
    recompute: Literal["selective", "full"] | None = doc_field(
        None, "activation recomputation: null (none), selective (core attention), full (whole layers)"
    )
    recompute_method: Literal["uniform", "block"] = doc_field("uniform", "megatron recompute_method for full recompute")
    recompute_num_layers: int = doc_field(1, "layers per recompute chunk (uniform) or recomputed layers per stage (block)")
    sequence_parallel: bool = doc_field(False, "megatron sequence parallelism (needs parallel.tp > 1)")
    cp_comm_type: Literal["p2p", "a2a", "allgather", "a2a+p2p"] = doc_field(
        "p2p", "Transformer Engine's context-parallel exchange: p2p (K/V ring) or a2a (all-to-all of Q/K/V); "
        "allgather and a2a+p2p are refused (TE rejects them for packed THD sequences), a2a for multi-latent "
        "attention and where CP does not divide each TP rank's heads; megarl's local attention always all-gathers K/V"
    )
    logprob_chunk_tokens: int = doc_field(
        4096, "log-probs / entropy / values are computed over this many response tokens at a time (with "
        "gradients, each chunk is recomputed in the backward): float32 logits memory is chunk x vocab/tp"
    )
    moe_aux_loss_coeff: float = doc_field(
        0.0, "MoE load-balancing loss coefficient (megatron moe_aux_loss_coeff); 0 = off, the RL default (the "
        "router is trained by the policy loss only)"
    )
    moe_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = doc_field(
        "aux_loss", "megatron moe_router_load_balancing_type used when model.moe_aux_loss_coeff > 0"
    )
    freeze_router: bool = doc_field(
        False, "MoE: the routers' weights get no gradient and no optimizer state (they stay as loaded)"
    )
    moe_expert_bias_update_rate: float = doc_field(
        0.0, "DeepSeek-V3 / Kimi-K2 / GLM-4.5: after each actor step megatron's aux-loss-free balancing moves every "
        "router's selection bias (e_score_correction_bias) by this much towards the step's mean expert load "
        "(megatron moe_router_bias_update_rate); 0 = the bias stays as loaded, the RL default (it is never trained, "
        "and a bias chasing the rollouts' load would change routing for a reason the loss does not see)"
    )
    freeze_vision: bool = doc_field(
        False, "vision-language models: the vision tower (patch embedding, blocks, merger) gets no gradient and no "
        "optimizer state in the trained models (actor, critic)"
    )


@dataclass
class ParallelConfig:
    tp: int = doc_field(1, "tensor-parallel size of the trained models")
    pp: int = doc_field(1, "pipeline-parallel size")
    cp: int = doc_field(1, "context-parallel size: every sequence split in 2*cp load-balanced chunks (megarl local attention or TE)")
    ep: int = doc_field(1, "expert-parallel size (MoE models only)")
    vpp: int | None = doc_field(None, "virtual pipeline stages per rank (interleaved 1F1B); needs pp > 1")
    etp: int | None = doc_field(None, "expert tensor-parallel size; null = tp")
    rollout_tp: int = doc_field(1, "tensor-parallel size of each rollout engine instance")
    nodes: int = doc_field(1, "nodes in the job (launchers and planner; world = nodes * gpus_per_node on GPU)")
    gpus_per_node: int = doc_field(8, "GPUs per node (launchers and planner)")
    collective_timeout_s: float = doc_field(
        1800.0, "a collective waiting longer than this for another rank fails (lost rank / hung peer): the job "
        "ends with an error naming the phase, so a scheduler can requeue it with trainer.resume=true"
    )


@dataclass
class DataConfig:
    train_path: str | None = doc_field(
        None, "training prompts: a .jsonl / .parquet file or a directory of them, a datasets.save_to_disk folder, or "
        "hf:NAME?split=SPLIT from the HF cache (docs/ecosystem.md)")
    eval: list[str | dict[str, Any]] = doc_field(
        [], "eval datasets: paths to configs/eval/*.yaml or inline mappings (validated by megarl.data)"
    )
    prompt_key: str = doc_field(
        "problem", "row field holding the prompt / problem text, or a chat list of {role, content} messages; every "
        "*_key may be a dotted path into nested fields (verl: reward_model.ground_truth)")
    answer_key: str = doc_field("answer", "row field holding the ground-truth answer")
    reference_key: str = doc_field("reference", "row field holding a reference / anchor response (GenRM, Pairwise-RL)")
    source_key: str = doc_field("data_source", "row field naming the reward route (e.g. math, code)")
    default_data_source: str = doc_field("math", "reward route for rows without source_key")
    prompt_template: str = doc_field("dapo", "prompt template name (dapo, boxed, raw, chat; see megarl.data)")
    apply_chat_template: bool = doc_field(False, "wrap the templated prompt with the tokenizer's chat template")
    max_prompt_len: int = doc_field(2048, "prompts longer than this many tokens (image and video tokens included) are skipped and counted")
    image_key: str = doc_field(
        "images", "row field holding a row's images (vision-language models): paths relative to the data file, "
        "base64 / data URIs, or {bytes|path} mappings"
    )
    image_placeholder: str = doc_field("<image>", "marker in the prompt text where each image goes (none: images first)")
    max_image_tokens: int | None = doc_field(
        None, "rows with an image of more tokens than this (after the processor's resize) are skipped and counted; null = no limit"
    )
    video_key: str = doc_field("videos", "row field holding a row's videos: a list of videos, each a list of frames (as image entries) or {frames, fps | timestamps}")
    video_placeholder: str = doc_field("<video>", "marker in the prompt text where each video goes (none: videos first)")
    max_video_tokens: int | None = doc_field(None, "rows with a video of more tokens than this are skipped and counted; null = no limit")
    shuffle: bool = doc_field(True, "shuffle the training prompts every epoch")
    seed: int = doc_field(42, "data shuffling seed")
    first_sources: list[str] = doc_field(
        [], "data sources trained first (RLHF data-scaling paper: [math, code]); their share of each batch "
        "starts at 1 and decays to their share of the dataset over data.first_sources_steps"
    )
    first_sources_steps: int = doc_field(0, "steps over which the first sources' share decays to the natural mix")
    first_sources_decay: str = doc_field(
        "linear", "linear (share 1 -> natural linearly) or step (only first sources, then the natural mix); "
        "the paper does not state the schedule"
    )


@dataclass
class RolloutConfig:
    engine: Literal["builtin", "sglang"] = doc_field("builtin", "rollout engine: builtin (torch, anywhere) or sglang (GPU)")
    n_samples_per_prompt: int = doc_field(16, "responses sampled per prompt (group size G)")
    prompts_per_step: int = doc_field(512, "prompts per training step (after dynamic-sampling filtering)")
    temperature: float = doc_field(1.0, "sampling temperature (also divides the trainer's logits)")
    top_p: float = doc_field(1.0, "nucleus sampling threshold")
    top_k: int = doc_field(-1, "top-k sampling; -1 = off")
    max_new_tokens: int = doc_field(20480, "hard cap on generated tokens per response (L_max)")
    fire: bool = doc_field(False, "FIRE sampling: first token at fire_temperature with fire_top_k")
    fire_temperature: float = doc_field(30.0, "FIRE first-token temperature")
    fire_top_k: int = doc_field(16, "FIRE first-token top-k")
    function: str | None = doc_field(
        None, "custom rollout function 'package.module:function' with the signature of "
        "megarl.trainer.step_collector.collect_step_batch; null = the builtin one"
    )
    weight_bucket_mb: int = doc_field(512, "bucket size for streaming weights into the engine (MiB)")
    weights_dtype: str = doc_field(
        "bf16", "the rollout engine's weights: bf16 (as trained), or fp8: the stream quantizes the linear weights "
        "of attention and MLP to block FP8 (128 x 128 blocks, float32 scales; megarl.weights.fp8_blocks), SGLang "
        "serves them in FP8 (half the engine's weight memory), the builtin engine dequantizes them; the log-prob "
        "mismatch this adds is what algorithm.rollout_is corrects"
    )
    mem_fraction: float = doc_field(0.6, "GPU memory fraction the engine reserves for weights + KV cache (SGLang mem_fraction_static)")
    kv_cache_gb: float | None = doc_field(
        None, "builtin engine: refuse a generate call whose KV cache (layers * 2 * batch * (prompt + max_new) * "
        "kv_heads * head_dim * dtype bytes) exceeds this many GiB; null = no limit (reported as rollout/kv_cache_gb)"
    )
    sglang_context_length: int | None = doc_field(
        None, "SGLang context_length (prompt + response tokens per request); null = data.max_prompt_len + the "
        "larger of rollout.max_new_tokens and eval.max_new_tokens"
    )
    sglang_chunked_prefill_size: int | None = doc_field(
        None, "SGLang chunked_prefill_size (prefill tokens per forward; -1 = no chunking); null = SGLang's default"
    )
    sglang_dp_size: int = doc_field(
        1, "SGLang attention data parallelism inside one engine (dp_size with enable_dp_attention when > 1): the "
        "engine's parallel.rollout_tp GPUs form that many attention groups, each holding its own sequences' KV "
        "cache, so the engine's KV pool grows with its GPUs; MoE models, with rollout.sglang_ep_size"
    )
    sglang_ep_size: int = doc_field(
        1, "SGLang expert parallelism inside one engine (ep_size): its routed experts split over that many of the "
        "engine's GPUs (a divisor of parallel.rollout_tp); the weight sync then sends each engine GPU only the "
        "experts it hosts"
    )
    sglang_server_args: dict[str, Any] = doc_field(
        {}, "further sglang.Engine keyword arguments (ServerArgs fields), e.g. {attention_backend: triton, "
        "sampling_backend: pytorch} where flashinfer is missing; the fields megarl sets itself are refused"
    )
    offload_train_state: bool = doc_field(
        True, "colocated: move actor/critic/ref weights, grads and optimizer state off the GPU during rollout"
    )
    sync_from_host: bool = doc_field(
        False, "the weight sync streams the actor's weights from host memory (they leave the GPU with the rest of "
        "the training state before the engine's weights come back; each bucket is copied in): the sync needs "
        "only the engine's weights + the stream's buffers on the GPU; for models whose trainer and engine "
        "weights do not fit a GPU together (Kimi-K2). Needs offload_train_state"
    )
    gen_batch_prompts: int | None = doc_field(None, "prompts generated per round; null = prompts_per_step (DAPO: 3x)")
    max_gen_batches: int = doc_field(10, "dynamic sampling: generation rounds before giving up with an error")
    carry_over_groups: bool = doc_field(
        False, "dynamic sampling: keep accepted groups beyond prompts_per_step for the next step (checkpointed); "
        "false = truncate to the batch and drop them (verl recipe/dapo)"
    )
    window_tokens: int | None = doc_field(
        None, "T-PPO successive batching: each step generates at most this many new tokens for every active sample; "
        "unfinished samples carry over to the next step, freed slots take new prompts; null = whole responses"
    )
    max_staleness: int | None = doc_field(
        None, "T-PPO: a carried sample whose first window is more than this many policy versions old is handled by "
        "rollout.stale_action before it continues; null = no cap"
    )
    stale_action: Literal["restart", "drop"] = doc_field(
        "restart", "T-PPO: a sample over rollout.max_staleness restarts its response under the current policy "
        "(keeping its slot), or is dropped (its slot takes a new prompt)"
    )
    tools: ToolsConfig = doc_field(ToolsConfig(), "tool-calling rollouts (docs/tools.md)")


PAG_VERIFY_INSTRUCTION = (  # the released PAG code's verifier turn (docs/algorithms.md §8)
    "Check the math solution step-by-step. If you find a mistake: state the wrong step, explain why it's wrong, "
    "and end your response with 'The answer is wrong'. If all steps are correct, end your response with "
    "'The answer is correct'."
)
PAG_REVISE_INSTRUCTION = (
    "You indicated that your previous answer was wrong. Please provide the correct solution to the math problem."
)


@dataclass
class PagConfig:
    """PAG, Policy as Generative Verifier (docs/algorithms.md §8; megarl/rollout/multi_turn.py, megarl/trainer/pag.py)."""

    enable: bool = doc_field(
        False, "multi-turn PAG rollouts: solution, self-verification, revision only on 'The answer is wrong'; "
        "per-turn rewards, turn-independent GAE, RoleAdvNorm (needs algorithm.advantage=gae)")
    max_policy_turns: int = doc_field(2, "T_max: policy (solution) turns per trajectory, the first attempt included (paper 2)")
    alpha: float = doc_field(1.0, "revision bonus alpha * (R_y(y_t) - R_y(y_t-1)) on revision turns (paper 1)")
    verify_instruction: str = doc_field(
        PAG_VERIFY_INSTRUCTION, "text appended (template tokens, no loss) before each verification turn; default "
        "the paper's. Plain text: a chat model's turn markers belong in it")
    revise_instruction: str = doc_field(
        PAG_REVISE_INSTRUCTION, "text appended (template tokens, no loss) before each revision turn; default the paper's")
    answer_tail_chars: int = doc_field(
        300, "a policy turn's answer is checked on its last this many characters (the released code: 300)")
    turn_independent: bool = doc_field(
        True, "turn-independent GAE: no value or advantage crosses a turn boundary (false: one GAE over the whole "
        "trajectory, the paper's ablation)")
    role_adv_norm: bool = doc_field(
        True, "RoleAdvNorm: whiten advantages separately over policy-turn and verifier-turn tokens "
        "(algorithm.whiten_advantages must be on); false = whitened together")


@dataclass
class AlgorithmConfig:
    name: str = doc_field("grpo", "informational recipe name (dapo, vapo, ppo, ...)")
    advantage: str = doc_field(
        "grpo", "advantage estimator: gae, egae, grpo, rloo, reinforce_pp, reinforce_pp_baseline, remax, opo, gpg, or "
        "'package.module:function' (signature of megarl.algorithms.ADVANTAGES entries)"
    )
    norm_adv_by_std: bool = doc_field(True, "GRPO: divide by the group std (false = Dr. GRPO)")
    whiten_advantages: bool = doc_field(False, "whiten advantages over all masked tokens of the batch (GAE)")
    policy_loss: str = doc_field(
        "ppo", "policy loss (megarl.algorithms.POLICY_LOSSES): ppo (clipped), vanilla_pg, gspo, gspo_token, cispo, "
        "sapo, clip_cov, kl_cov, gmpo, gpg (megarl/algorithms/objectives.py)"
    )
    loss_agg: LossAgg = doc_field(
        "token-mean",
        "loss aggregation, denominators global over the mini-batch: token-mean sum(l)/N_tok; seq-mean-token-mean "
        "sum_i mean_t(l)/N_seq; seq-mean-token-sum sum(l)/N_seq; seq-mean-token-sum-norm (Dr. GRPO) "
        "sum(l)/(N_seq * rollout.max_new_tokens)",
    )
    clip_low: float = doc_field(0.2, "PPO ratio clip epsilon below 1")
    clip_high: float = doc_field(0.2, "PPO ratio clip epsilon above 1 (clip-higher: > clip_low)")
    clip_c: float | None = doc_field(None, "dual-clip constant c (> 1) for negative advantages; null = off")
    gspo_clip_low: float = doc_field(3e-4, "GSPO / GSPO-token: sequence-ratio clip epsilon below 1 (paper 3e-4)")
    gspo_clip_high: float = doc_field(4e-4, "GSPO / GSPO-token: sequence-ratio clip epsilon above 1 (paper 4e-4)")
    cispo_clip_low: float | None = doc_field(
        None, "CISPO: IS-weight clip epsilon below 1; null = no lower bound (MiniMax-M1 sets it 'large')"
    )
    cispo_clip_high: float = doc_field(
        0.2, "CISPO: IS-weight clip epsilon above 1 (tuned in MiniMax-M1, value not stated; verl's example 0.2)"
    )
    sapo_tau_pos: float = doc_field(1.0, "SAPO: soft-gate temperature for positive advantages (paper 1.0)")
    sapo_tau_neg: float = doc_field(1.05, "SAPO: soft-gate temperature for advantages <= 0 (paper 1.05)")
    clip_cov_ratio: float = doc_field(2e-4, "Clip-Cov: fraction of a micro-batch's tokens whose gradient is detached (2e-4)")
    clip_cov_lb: float = doc_field(1.0, "Clip-Cov: lower bound of the covariance range tokens are drawn from (1.0)")
    clip_cov_ub: float = doc_field(5.0, "Clip-Cov: upper bound of the covariance range tokens are drawn from (5.0)")
    kl_cov_ratio: float = doc_field(
        2e-4, "KL-Cov: fraction of a micro-batch's tokens (top covariance) that get the KL penalty (paper 2e-3 7B, 2e-4 32B)"
    )
    kl_cov_coef: float = doc_field(1.0, "KL-Cov: coefficient of |logp - logp_old| on the selected tokens (paper 1.0)")
    gmpo_clip_low: float = doc_field(0.4, "GMPO: log-ratio clip below 0 (ratio >= e^-eps; paper 0.4)")
    gmpo_clip_high: float = doc_field(0.4, "GMPO: log-ratio clip above 0 (ratio <= e^eps; paper 0.4)")
    gpg_alpha: bool = doc_field(True, "GPG advantage: scale by B/(B-M), M = samples of groups with equal scores (paper)")
    gpg_norm_by_std: bool = doc_field(False, "GPG advantage: divide by the group std (F_norm = std; paper default F_norm = 1)")
    gamma: float = doc_field(1.0, "discount")
    lam_actor: float = doc_field(1.0, "GAE lambda of the policy advantages")
    lam_critic: float = doc_field(1.0, "GAE lambda of the critic targets (decoupled GAE)")
    length_adaptive_alpha: float | None = doc_field(None, "VAPO length-adaptive lambda alpha (0.05); null = fixed lam_actor")
    kl_coef: float = doc_field(0.0, "KL coefficient beta (0 = no reference model)")
    kl_type: KLType = doc_field("k3", "KL estimator")
    kl_in_reward: bool = doc_field(False, "apply KL as a per-token reward penalty instead of a loss term")
    kl_target: float | None = doc_field(
        None, "adaptive KL controller target (KL-in-reward only; Ziegler et al.): kl_coef is the initial "
        "beta; null = fixed kl_coef"
    )
    kl_horizon: float = doc_field(10000.0, "adaptive KL controller horizon in samples")
    entropy_coef: float = doc_field(0.0, "entropy bonus coefficient")
    pos_lm_coef: float = doc_field(0.0, "VAPO positive-example NLL weight mu (0.1)")
    value_clip: float | None = doc_field(0.5, "value clipping epsilon; null = no clipping")
    dynamic_sampling: bool = doc_field(False, "DAPO: drop groups whose accuracy is 0 or 1 and resample")
    overlong_penalty: bool = doc_field(False, "DAPO soft overlong punishment")
    overlong_max_len: int | None = doc_field(
        None, "L_max of the soft overlong punishment (<= rollout.max_new_tokens); null = rollout.max_new_tokens"
    )
    overlong_cache_len: int = doc_field(4096, "L_cache of the soft overlong punishment")
    overlong_factor: float = doc_field(1.0, "scale of the soft overlong punishment")
    overlong_filter: bool = doc_field(False, "mask out truncated samples from the loss")
    rollout_is: Literal["tis", "mis"] | None = doc_field(
        None, "off-policy correction with rho = exp(trainer old log-prob - rollout log-prob) per policy token: tis "
        "(weight min(rho, C)), mis (tokens with rho > C leave the policy loss, the rest weighted by rho); null = off"
    )
    rollout_is_cap: float = doc_field(2.0, "C of algorithm.rollout_is: the TIS weight cap / the MIS ratio threshold (>= 1)")
    routing_replay: bool = doc_field(
        False, "MoE routing replay (R3): the rollout engine records every token's experts and the actor's routers use "
        "them in the old-log-prob and training passes (megarl.models.routing); MoE models only. The per-step metric "
        "moe/routing_agreement is logged for MoE models either way"
    )
    retrain_earlier_windows: bool = doc_field(
        False, "T-PPO: the policy loss also covers the earlier windows of a continuing response (not stated in the "
        "paper); false = only the tokens of the current window"
    )
    value_pretrain_steps: int = doc_field(
        0, "critic-only warm-up steps before policy updates (VAPO 50); with value_pretrain_ev_target, the cap")
    value_pretrain_ev_target: float | None = doc_field(
        None, "end value pretraining early, at the first step whose critic/explained_variance (values before "
        "that step's critic update, on its fresh rollouts) is >= this; policy training and the actor's lr "
        "schedule start at the next step (checkpointed). null = always value_pretrain_steps steps")
    ppo_epochs: int = doc_field(1, "passes over each rollout batch")
    mini_batch_size: int = doc_field(512, "samples per optimizer step")
    pag: PagConfig = doc_field(PagConfig(), "PAG multi-turn self-verification (docs/algorithms.md §8)")


@dataclass
class OptimConfig:
    lr: float = doc_field(1e-6, "peak learning rate")
    min_lr: float = doc_field(0.0, "final learning rate of linear / cosine decay")
    lr_warmup_steps: int = doc_field(0, "linear warm-up length in rollout steps")
    lr_decay_style: DecayStyle = doc_field("constant", "schedule after warm-up")
    lr_decay_steps: int | None = doc_field(None, "decay length in rollout steps; null = trainer.total_steps")
    weight_decay: float = doc_field(0.1, "AdamW weight decay")
    adam_beta1: float = doc_field(0.9, "AdamW beta1")
    adam_beta2: float = doc_field(0.999, "AdamW beta2")
    adam_eps: float = doc_field(1e-8, "AdamW epsilon")
    clip_grad: float = doc_field(1.0, "global gradient-norm clip; 0 = off")
    max_tokens_per_microbatch: int = doc_field(
        32768, "token budget of one packed micro-batch per DP rank (split over CP ranks); a sample never spans two"
    )
    use_distributed_optimizer: bool = doc_field(True, "shard fp32 master weights and Adam states over DP (x CP)")
    offload_optimizer: bool = doc_field(False, "Adam state and update on the CPU (megatron HybridDeviceOptimizer; GPU runs only)")


@dataclass
class CriticConfig(OptimConfig):
    enable: bool = doc_field(False, "train a critic (required by gae / egae)")
    init_from: str = doc_field(
        "actor", "'actor' (copy the actor's backbone + new value head), a critic checkpoint path (value head "
        "included) or a policy checkpoint path (its backbone + new value head)")
    lr: float = doc_field(2e-6, "peak learning rate")


@dataclass
class TrainerConfig:
    total_steps: int = doc_field(1000, "rollout steps to train")
    seed: int = doc_field(1, "global seed (model init, sampling)")
    run_dir: str = doc_field("runs/default", "output directory: resolved config, checkpoints, TensorBoard logs")
    save_interval: int = doc_field(50, "checkpoint every N steps (0 = only at the end)")
    keep_last: int | None = doc_field(3, "checkpoints to keep; null = keep all")
    eval_interval: int = doc_field(50, "evaluate every N steps (0 = never)")
    log_interval: int = doc_field(1, "log metrics every N steps")
    resume: bool = doc_field(False, "resume from the latest checkpoint in run_dir (a fresh start when there is none)")
    async_save: bool = doc_field(
        False, "write checkpoints in background processes (megatron dist_checkpointing async save) while training "
        "goes on; `latest` moves only after every rank's files are finalised"
    )
    tensorboard: bool = doc_field(
        True, "write TensorBoard event files under run_dir/tb; false drops 'tensorboard' from trainer.loggers "
        "(kept for older configs)")
    val_before_train: bool = doc_field(False, "evaluate once before the first step")
    # ---- metrics loggers (megarl.trainer.loggers; docs/ecosystem.md) ----
    loggers: list[Literal["tensorboard", "jsonl", "wandb", "mlflow"]] = doc_field(
        ["tensorboard", "jsonl"], "where rank 0 sends the metrics: tensorboard (run_dir/tb), jsonl "
        "(run_dir/metrics.jsonl: the quickstart, megarl report and resume read it), wandb, mlflow")
    project: str = doc_field("megarl", "W&B project / MLflow experiment the run is logged under")
    run_name: str | None = doc_field(None, "W&B / MLflow run name; null = the run dir's name")
    tags: list[str] = doc_field([], "tags of the W&B / MLflow run (MLflow: one tag key per entry)")
    wandb_mode: Literal["online", "offline"] | None = doc_field(
        None, "W&B mode; offline writes run_dir/wandb only ($WANDB_DIR/wandb when WANDB_DIR is set; upload later "
        "with `wandb sync`); null = the WANDB_MODE environment variable, else online")
    wandb_entity: str | None = doc_field(None, "W&B entity (user or team); null = W&B's default for the API key")
    mlflow_tracking_uri: str | None = doc_field(
        None, "MLflow tracking URI (http(s)://server or a file store path); null = MLFLOW_TRACKING_URI, else a "
        "file store in run_dir/mlruns")


@dataclass
class EvalConfig:
    n_samples: int = doc_field(32, "samples per prompt (avg@k)")
    temperature: float = doc_field(1.0, "eval sampling temperature")
    top_p: float = doc_field(0.7, "eval nucleus threshold")
    max_new_tokens: int = doc_field(20480, "eval generation cap")


@dataclass
class SftConfig:
    data_path: str | None = doc_field(None, "SFT data (.jsonl with prompt/response or messages)")
    epochs: int = doc_field(1, "passes over the SFT data")
    max_steps: int | None = doc_field(None, "stop after this many optimizer steps (null = epochs over the data)")
    lr: float = doc_field(1e-5, "SFT peak learning rate (constant after warm-up)")
    lr_warmup_steps: int = doc_field(10, "SFT linear warm-up steps")
    batch_size: int = doc_field(64, "samples per optimizer step")
    max_len: int = doc_field(4096, "longer samples are skipped and counted")


@dataclass
class QuickstartConfig:
    task: str = doc_field(
        "arith", "synthetic task megarl quickstart writes and trains on: a name registered in megarl.tasks "
        "(module megarl.tasks.<task>), e.g. arith")
    family: Literal["qwen2", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "qwen2_5_vl", "qwen3_vl_moe",
                    "qwen3_5_moe"] = doc_field(
        "qwen2", "tiny model that megarl quickstart builds: dense Qwen2, Qwen3-MoE / Qwen2-MoE (shared expert), "
        "DeepSeek-V3 (multi-latent attention) / GLM-4.5 (sigmoid routing with a selection bias, shared expert, "
        "dense first layer), or the vision-language Qwen2.5-VL (megarl.tasks.tiny_vlm) / Qwen3-VL-MoE / "
        "Qwen3.5-MoE (gated delta-net layers; megarl.tasks.tiny_qwen3_vl; quickstart.num_experts etc.), with "
        "their image processors")
    num_experts: int = doc_field(8, "experts per MoE layer of the tiny MoE model (MoE families only)")
    moe_topk: int = doc_field(2, "experts each token is routed to (MoE families only)")
    moe_intermediate: int = doc_field(
        192, "FFN size of each expert (and of the shared expert of qwen2_moe, deepseek_v3, glm4_moe); dense "
        "intermediate 384 / moe_topk = the dense model's MLP FLOPs per token")
    critic_sft_steps: int = doc_field(
        0, "with a critic: SFT steps more than the policy's warm start for the critic's initial backbone "
        "(continued from the policy's SFT checkpoint into <run_dir>/sft_critic, then critic.init_from); "
        "0 = the critic starts from the actor")


@dataclass
class PrmConfig:
    """Code PRM (docs/algorithms.md §10; megarl.algorithms.prm, megarl.trainer.prm)."""

    path: str | None = doc_field(
        None, "PRM checkpoint dir (a critic-architecture torch_dist checkpoint); null = <trainer.run_dir>/prm. "
        "The code_lines quickstart labels and trains one there before RL when it is missing")
    dense_reward: bool = doc_field(
        False, "add lambda * PRM(x, y<=line j) / n_lines on the last token of every line j to the outcome reward "
        "([NS->C] equation; gae/egae only)")
    lambda_fail: float = doc_field(0.25, "dense-reward lambda when the final code fails the tests (paper 0.25)")
    lambda_pass: float = doc_field(0.025, "dense-reward lambda when the final code passes the tests (paper 0.025)")
    init_critic: bool = doc_field(
        False, "initialise the critic from the PRM checkpoint (backbone + scalar head copied; [NS->C])")
    label_k: int = doc_field(20, "labelling: completions sampled per response prefix; a prefix is positive if any passes (paper 20)")
    label_prompts: int = doc_field(64, "labelling: training prompts (the first ones) the policy answers")
    label_samples: int = doc_field(4, "labelling: policy responses per prompt")
    train_steps: int = doc_field(100, "PRM training steps (MSE at line ends; optimizer settings of the critic section)")
    batch_size: int = doc_field(32, "labelled responses per PRM training step")


def default_reward() -> dict[str, Any]:
    return {"correct_score": 1.0, "incorrect_score": -1.0}


@dataclass
class MegaRLConfig:
    model: ModelConfig = doc_field(ModelConfig(), "model and precision")
    parallel: ParallelConfig = doc_field(ParallelConfig(), "parallel layout")
    data: DataConfig = doc_field(DataConfig(), "prompt data")
    rollout: RolloutConfig = doc_field(RolloutConfig(), "generation")
    algorithm: AlgorithmConfig = doc_field(AlgorithmConfig(), "advantages, losses, shaping")
    actor: OptimConfig = doc_field(OptimConfig(), "actor optimizer and micro-batching")
    critic: CriticConfig = doc_field(CriticConfig(), "critic optimizer and micro-batching")
    reward: dict[str, Any] = doc_field(
        default_reward(), "free-form reward settings, validated by megarl.rewards (RewardConfig)"
    )
    trainer: TrainerConfig = doc_field(TrainerConfig(), "loop, checkpoints, logging")
    eval: EvalConfig = doc_field(EvalConfig(), "evaluation sampling")
    sft: SftConfig = doc_field(SftConfig(), "supervised fine-tuning (megarl sft)")
    quickstart: QuickstartConfig = doc_field(QuickstartConfig(), "the tiny model of megarl quickstart")
    prm: PrmConfig = doc_field(PrmConfig(), "code process reward model: dense line rewards, critic init")
