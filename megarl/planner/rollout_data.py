"""The rollout data of one step per rank (megarl/trainer/rows.py is what it models).

Every engine owner keeps the rows it generated; every rank receives the metadata of every row
(a small record each) and the payloads of the rows its DP replica trains, once; nothing else.

A row's payload on the wire (`row_bytes`; megarl.trainer.rows.encode_row): token ids int32,
log-probs float32, the routed experts of the receiving rank's pipeline stage's MoE layers
(uint8 with <= 256 experts, else int16) when routing replay is on, the images' pixels (float32)
and grids, plus ROW_FIXED bytes of framing and small fields and TENSOR_FIXED per tensor
(tests/unit/test_planner_rollout_data.py holds these constants against the encoder).

Per rank, with N = prompts_per_step * n rows a step, N_r = gen_batch_prompts (or prompts_per_step)
* n rows a generation round, E engines (world / rollout_tp with SGLang, world with the builtin
engine), DP replicas, and R rounds (--gen-rounds):
  received  N / DP payloads (all of a rank's replica's rows, cut to its stage's MoE layers)
  generated N_r / E payloads of the owner's round (all layers: routed experts as recorded),
            plus with dynamic sampling the kept groups of earlier rounds, at most N / E
  meta      R * N_r * META_BYTES (every rank; the per-sample scalars of the decisions)
  host peak generated + received (the moment the payloads are delivered)
  GPU       the micro-batch being run only: tokens * (3 int64 ids / positions / targets + the
            stage's routed experts), tokens = max_tokens_per_microbatch / CP
"""

from __future__ import annotations

import math

ROW_FIXED = 68  # bytes per row: framing, index, uid (~16 characters), finish reason, scores, versions
TENSOR_FIXED = 28  # bytes per tensor on the wire: dtype name and shape
META_BYTES = 100  # bytes per row of the all-gathered metadata (megarl.trainer.rows.RowMeta, pickled)


def routing_bytes(num_experts: int) -> int:
    return 1 if 0 < num_experts <= 256 else 2


def row_bytes(prompt: float, response: float, routed_layers: int, topk: int, routing_bytes_: int,
              image_bytes: float = 0.0) -> float:
    """Wire bytes of one row (module docstring)."""
    tokens = prompt + response
    tensors = (routed_layers > 0) + (2 if image_bytes else 0)
    return (ROW_FIXED + TENSOR_FIXED * tensors + 4 * tokens + 4 * response
            + tokens * routed_layers * topk * routing_bytes_ + image_bytes)


def sample_image_bytes(arch, images) -> float:
    """float32 pixels of a sample's images (patches x channels x temporal patch x patch^2) + grids."""
    v = arch.vision
    if v is None or images is None:
        return 0.0
    return images.per_sample * (images.patches * v.in_channels * v.temporal_patch * v.patch**2 * 4 + 24)


def rollout_data(cfg, arch, world: int, prompt: float, response: float, images=None,
                 gen_rounds: int = 1) -> dict[str, float]:
    """Per-rank bytes of a step's rollout data (module docstring)."""
    p, r, al = cfg.parallel, cfg.rollout, cfg.algorithm
    dp = max(1, world // (p.tp * p.pp * p.cp))
    engines = max(1, world // p.rollout_tp) if r.engine == "sglang" else world
    rows = r.prompts_per_step * r.n_samples_per_prompt
    round_rows = (r.gen_batch_prompts or r.prompts_per_step) * r.n_samples_per_prompt if al.dynamic_sampling else rows
    replay = al.routing_replay and arch.num_experts > 0
    rb = routing_bytes(arch.num_experts)
    stage_moe = math.ceil(arch.moe_layers / p.pp) if replay else 0
    all_layers = arch.layers if replay else 0
    img = sample_image_bytes(arch, images)
    received = rows / dp * row_bytes(prompt, response, stage_moe, arch.moe_topk, rb, img)
    kept = rows / engines if al.dynamic_sampling and gen_rounds > 1 else 0.0
    generated = (round_rows / engines + kept) * row_bytes(prompt, response, all_layers, arch.moe_topk, rb, img)
    tokens = cfg.actor.max_tokens_per_microbatch / p.cp
    return {"received": received, "generated": generated, "meta": gen_rounds * round_rows * META_BYTES,
            "host_peak": received + generated, "gpu": tokens * (3 * 8 + stage_moe * arch.moe_topk * rb),
            "rows_per_rank": rows / dp}
