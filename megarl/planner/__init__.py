"""The planner: per-GPU memory in the rollout and train phases of a megarl run, and a step-time estimate.

    megarl plan --recipe configs/recipes/qwen2.5-32b/dapo.yaml \
        --layout configs/layouts/qwen2.5-32b/16node.yaml --nodes 16 --gpu h100

Modules: `arch` (the architecture from config.json, GPUs, the model states' type), `activations`
(the train phase's activation memory), `vision` (the vision tower and the image load), `memory`
(the phases, the plan and the time model), `cli` (the command). It reads configs and HF
config.json files only: no torch, no model is built.

Memory model (bytes per GPU; P_gpu = parameters held by the GPU's TP x PP shard, from the HF
config: embedding and output layer counted on the first / last pipeline stage, vocab-parallel
over TP; norms replicated; the largest stage is reported):
  weights    2 * P_gpu (bf16; 4 for fp32)                    actor, critic, reference (kl_coef > 0)
  grads      4 * P_gpu (megatron DDP's grad buffer, float32: grad_reduce_in_fp32) actor, critic
  optimizer  12 * P_gpu / (DP * CP) with the distributed optimizer (fp32 master + Adam m, v),
             12 * P_gpu without it                                           actor, critic
Mixture of experts (qwen3_moe, qwen2_moe): P_gpu = P_dense + P_expert, where P_dense is the
  above without the routed experts (the router E x h and the shared expert gate replicated over
  TP, the shared expert TP-sharded) and P_expert = layers_per_stage * E * 3*h*f_e / (EP * ETP)
  (every GPU holds E/EP experts, each split over expert-TP; ETP = parallel.etp or tp). The
  distributed optimizer shards P_dense over DP x CP = world / (TP * PP) and P_expert over the
  expert-data-parallel group, EDP = world / (ETP * EP * PP):
  optimizer  12 * P_dense / (DP * CP) + 12 * P_expert / EDP.
  MoE activations, dispatcher (alltoall) and grouped GEMM buffers: megarl/planner/activations.py.
DeepSeek-V3 / Kimi-K2 / GLM-4.5: the first dense_layers layers hold a dense MLP (no experts), the
  shared expert has no gate, the router a bias of E; multi-latent attention's parameters,
  activations and latent KV cache (the same on every engine GPU), and the engine's weights in one
  byte per parameter for a block-FP8 checkpoint: megarl/planner/mla.py.
Hybrid models (qwen3_next, qwen3_5, qwen3_5_moe): gated delta-net layers' parameters and
  activations, K / V in the attention layers only, and a recurrent state per sequence that does
  not grow with its length: megarl/planner/hybrid.py.
Vision-language models (qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe; the LM's fields from text_config or
  the top level, an MoE LM as above; megarl/planner/vision.py): the vision tower (VisionTower) sits on the first pipeline
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
  for them: megarl/planner/activations.py.
  activations, CP K/V exchange, attention workspace and logits of the model being trained: see
             megarl/planner/activations.py (per micro-batch of max_tokens_per_microbatch / CP tokens per GPU).
  rollout    the engine reserves rollout.mem_fraction of the GPU for its weights
             (2 * P_total / rollout_tp, vision tower included) and KV cache (2 * layers * kv_heads
             * head_dim * 2 bytes per token, / rollout_tp); colocated, the training state is offloaded during rollout
             when rollout.offload_train_state is true.
  reserve    --reserve-gib (CUDA contexts of trainer and engine, NCCL buffers, fragmentation).
Phases: sync = the actor's weights (with rollout.offload_train_state the gradients, optimizer
        state and the other models leave the GPU before the engine's weights come back, and with
        rollout.sync_from_host the actor's weights too; else all resident states) + the engine's weights + the stream's buffers (`memory.stream_transient_bytes`
        of a rollout.weight_bucket_mb bucket, + one more bucket for SGLang's flattened copy) + reserve;
        rollout = resident training state + engine share + reserve;
        train   = all resident model states + the larger of actor / critic activations + reserve
        (a model's optimizer step: its optimizer state on the GPU too, unless offload_optimizer keeps
        it on the host, where megatron's HybridDeviceOptimizer steps).
The GPU is --gpu (default h100; capacities as nvidia-smi reports them: GPUS). A phase over capacity
is reported with its terms; the train phase names its largest term and the settings that shrink it.

Rollout data per rank (megarl/planner/rollout_data.py): the payloads a rank receives (its DP
  replica's rows), the metadata every rank gets, the host peak and the GPU bytes of one micro-batch.

Time model (stated assumptions: --avg-prompt-len, --avg-response-len, --mfu, --decode-eff):
  training FLOPs = 6*N*T per epoch for actor and critic, 2*N*T per forward-only pass (old
  log-probs, reference, values; N = the parameters a token passes through, for an MoE model its
  active parameters: k of the E routed experts), plus causal attention 4*L*a*d*c per token forward (c = mean
  context), x3 for forward + backward (x4 with full recompute); time = FLOPs / (GPUs * peak * MFU).
  A vision-language model adds its images' tower FLOPs per sample (VisionTower.forward_flops:
  2 per weight per patch or merged token, non-causal attention 4 * patches * ctx * c per block)
  x (1 + 3 * epochs) for actor and critic (the tower is never recomputed), once for the reference
  and once in the rollout's prefill (2*N*prompt per sample there, image tokens included).
  decode (megarl/planner/engine.py): steps = max(longest response, tokens per engine / concurrent
  sequences the KV cache holds), at a mean batch of tokens per engine / steps; per step
  max((weight bytes + KV bytes read) / (HBM bw * eff), 2*N*batch / (rollout_tp * peak * eff))
  + the engine's communication (TP all-reduces; with attention DP the gathers or DeepEP
  all-to-alls of the MoE layers, over InfiniBand when the engine spans nodes); weight bytes = all
  LM parameters (a decode batch of hundreds of tokens routes to nearly every expert; the vision
  tower is not read), attention replicated over the attention-DP groups.
  host copies: rollout.offload_train_state moves the resident training state off and back, an
  offloaded optimizer moves gradients and weights at every update, at 25 GB/s per GPU
  (memory.host_transfer_s). Pipeline bubble: train time x (1 + (pp - 1) / (micro-batches x vpp)).
  The search (`megarl plan --search`, megarl/planner/search.py) ranks layouts by this step.
"""

from megarl.planner.activations import (
    activation_bytes, activation_bytes_per_token_layer, attention_workspace_bytes, cp_kv_exchange_bytes, logits_bytes,
    train_overflow_message, vision_bytes_per_patch)
from megarl.planner.arch import GIB, GPU, GPUS, MOE_IMBALANCE, Arch, ModelState, load_arch
from megarl.planner.cli import format_plan, main
from megarl.planner.memory import Plan, mean_lengths, model_states, plan, step_time, stream_transient_bytes
from megarl.planner.rollout_data import rollout_data, row_bytes
from megarl.planner.vision import (
    DEFAULT_IMAGE_PIXELS, VISION_DEFAULTS, Images, VisionTower, image_load, microbatch_patches, vision_problems)
from megarl.config import ConfigError

__all__ = [
    "Arch", "ConfigError", "DEFAULT_IMAGE_PIXELS", "GIB", "GPU", "GPUS", "Images", "MOE_IMBALANCE", "ModelState",
    "Plan", "VISION_DEFAULTS", "VisionTower", "activation_bytes", "activation_bytes_per_token_layer",
    "attention_workspace_bytes", "cp_kv_exchange_bytes", "format_plan", "image_load", "load_arch", "logits_bytes",
    "main", "mean_lengths", "microbatch_patches", "model_states", "plan", "rollout_data", "row_bytes", "step_time",
    "stream_transient_bytes", "train_overflow_message",
    "vision_bytes_per_patch", "vision_problems",
]
