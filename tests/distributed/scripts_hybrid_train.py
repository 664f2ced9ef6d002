"""Worker for tests/distributed/test_hybrid_train.py (2 gloo ranks, strict device mode): Qwen3-Next and
Qwen3.5-MoE (hybrid gated delta-net, MoE; Qwen3.5-MoE with images) in the trainer, against the
builtin engine.

Models: `scripts_hybrid.make_tiny` (4 layers, three delta-net layers and one gated attention layer,
4 experts top-2 with a gated shared expert). Batches: the builtin engine's samples (n = 2) of three
prompts (Qwen3.5-MoE: text-only, one image, two images), carrying the engine's experts.

layouts[family][tp{t}_ep{e}] at TP1 x EP1 (DP 2), TP1 x EP2 and TP2 (sequence parallel, expert-TP 2):
- the trainer's log-probs of the engine's samples with routing replay and agreement tracking on
  (engine vs trainer, the routing metrics);
- one PPO update and one DAPO update (token-level loss, clip-higher) on the batch: loss and grad
  norm (compared to TP1 x EP1 by the test);
- the updated actor streamed into a fresh builtin engine that samples again; the trainer's log-probs
  of those samples vs the engine's (`after_stream`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import transformers

from megarl.config import load_config
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.generation import trajectory_images
from tests.distributed.harness import dp_update, finish, from_rank0, on_rank0, parse_args, train_model
from tests.distributed.scripts_hybrid import make_tiny
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_qwen3_vl_common import make_prompt

START = time.time()
FAMILIES = ("qwen3_next", "qwen3_5_moe")
LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # (tp, ep); TP2 with sequence parallelism
BASE = ["actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.clip_grad=0.05", "actor.max_tokens_per_microbatch=96",
        "data.max_prompt_len=80", "rollout.max_new_tokens=8"]
CONFIGS = {"ppo": ("configs/algorithms/ppo.yaml", ["algorithm.entropy_coef=0.01"]),
           "dapo": ("configs/algorithms/dapo.yaml", ["algorithm.overlong_max_len=8", "algorithm.overlong_cache_len=4"])}


def prompts(family: str, seed: int):
    from megarl.rollout.types import PromptImages

    sizes = [((20, 37),), ((48, 40), (9, 9)), ()] if family == "qwen3_5_moe" else [(), (), ()]
    made = [make_prompt(s, seed=seed + k) for k, s in enumerate(sizes)]
    images = [None if im is None else PromptImages(im["pixel_values"], im["image_grid_thw"]) for _, im in made]
    return [p for p, _ in made], (images if family == "qwen3_5_moe" else None)


def engine_batch(engine, family: str, seed: int) -> StepBatch:
    ids, images = prompts(family, seed)
    samples = from_rank0(engine.generate(ids, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed),
                                         images=images))
    samples = [s for s in samples if not set(s.response_ids) & {150, 151}]  # a generated placeholder stays text
    return StepBatch.from_trajectories([
        Trajectory(uid=str(s.index), prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                   rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, routed_experts=s.routed_experts,
                   **trajectory_images(s.images)) for s in samples])


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    d = ((a - b).abs() * mask).max().reshape(1).to(device())
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def run_layout(cfgs: dict, path, hf_config, family: str, batch: StepBatch, tp: int, ep: int) -> dict:
    init_distributed(ParallelSizes(tp=tp, ep=ep), seed=3)
    out = {}
    for name, cfg in cfgs.items():  # a fresh model per objective: both updates start from the HF weights
        model = train_model(hf_config, cfg.actor, path, model_options={"sequence_parallel": tp > 1},
                            logprob_chunk_tokens=7, routing_replay=True, track_routing=True)
        b = batch.select(list(range(len(batch))))
        rl.set_masks(b, cfg)
        b.old_logprobs = rl.compute_log_probs(model, b, 1.0)
        if name == "ppo":
            out["engine"] = {"logprob_diff": masked_max(b.old_logprobs, b.rollout_logprobs, b.response_mask),
                             "tokens": int(b.response_mask.sum()), "microbatches": len(model.microbatches(b)),
                             **model.routing_metrics}
        b.old_logprobs = b.old_logprobs + 0.3 * torch.sin(torch.arange(b.width)) * b.response_mask
        b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(4)) * b.response_mask
        m = dp_update(model, cfg, b)
        out[name] = {"loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"]}
    engine = BuiltinEngine(hf_config.to_dict(), tokenizer=None)
    engine.update_weights(iter([list(streamed(model.modules, hf_config).items())]))
    after = engine_batch(engine, family, seed=11)
    rl.set_masks(after, cfgs["dapo"])
    after.old_logprobs = rl.compute_log_probs(model, after, 1.0)
    out["after_stream"] = {"logprob_diff": masked_max(after.old_logprobs, after.rollout_logprobs, after.response_mask),
                           "tokens": int(after.response_mask.sum()), **model.routing_metrics}
    return out


def main():
    a = parse_args()
    root = a.root
    init_distributed(ParallelSizes(), seed=3)
    on_rank0(lambda: [make_tiny(f, root / f, seed=k + 1) for k, f in enumerate(FAMILIES)])
    res = {"layouts": {}, "seconds": {}}
    for family in FAMILIES:
        budget = [] if family == "qwen3_5_moe" else ["actor.max_tokens_per_microbatch=40", "data.max_prompt_len=32"]  # short text rows
        cfgs = {name: load_config(path, BASE + extra + budget) for name, (path, extra) in CONFIGS.items()}
        path = root / family
        hf_config = transformers.AutoConfig.from_pretrained(path)
        batch = engine_batch(BuiltinEngine.from_pretrained(path, tokenizer=None), family, seed=3)
        res["layouts"][family] = {f"tp{tp}_ep{ep}": run_layout(cfgs, path, hf_config, family, batch, tp, ep)
                                  for tp, ep in LAYOUTS}
        res["seconds"][family] = time.time() - START
    finish(a.out, res)


if __name__ == "__main__":
    main()
