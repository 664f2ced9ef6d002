"""Worker for tests/distributed/test_qwen3_vl_train.py (2 gloo ranks, strict device mode): Qwen3-VL-MoE
and Qwen3-VL in the trainer with images and videos, against the builtin engine and HF.

Models (scripts_qwen3_vl_common, each saved by transformers' own `save_pretrained`: the MoE file
holds transformers 5's fused expert layout): a tiny qwen3_vl_moe (6 experts, top-2), a tiny
qwen3_vl (dense) and a tiny qwen2_5_vl (scripts_vlm_common).

Sections (rank 0 writes the JSON):
- video_logits[family]: max |Megatron - HF| logits of two rows holding a video (one also an image),
  at TP2 (the MoE at EP2);
- layouts[family][tp{t}_ep{e}]: the builtin engine's samples of prompts with images (batch
  "images": text-only, one image, two images) and with videos (batch "video") recomputed by the
  trainer (routing replay and agreement tracking on): engine vs trainer log-probs and the routing
  metrics; then one PPO update on each batch (loss, grad norm); then the updated actor's weights
  streamed into a fresh builtin engine that samples the mixed prompts again, and the trainer's
  log-probs of those samples vs the engine's (`after_stream`). MoE at TP1xEP1 (DP2), TP1xEP2 and
  TP2 (sequence parallel, expert-TP 2); dense at TP1 and TP2;
- freeze_vision: after an update at EP2 with model.freeze_vision the streamed `model.visual.*`
  tensors (DeepStack mergers included) are unchanged and the LM's moved;
- critic: a Qwen3-VL-MoE value model at TP2 (SP): values of the video batch, with the pixels zeroed,
  and after one update.
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
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_qwen3_vl_common import hf_model, make_prompt, make_tiny_qwen3_vl, mm_types

START = time.time()
LAYOUTS = {"moe": [(1, 1), (1, 2), (2, 1)], "dense": [(1, 1), (2, 1)]}  # (tp, ep); TP2 with sequence parallelism
IMAGES = [((20, 37),), ((48, 40), (9, 9)), ()]
VIDEOS = [(2, 4, 6), (3, 4, 4)]


def prompts(kind: str):
    if kind == "images":
        made = [make_prompt(sizes, seed=k) for k, sizes in enumerate(IMAGES)]
    elif kind == "video":
        made = [make_prompt(video=VIDEOS[0], seed=5), make_prompt([(16, 16)], video=VIDEOS[1], seed=6)]
    else:  # mixed
        made = [make_prompt([(20, 37)], seed=7), make_prompt(video=VIDEOS[0], seed=8), make_prompt(seed=9)]
    return [p for p, _ in made], [None if im is None else images_of_dict(im) for _, im in made]


def images_of_dict(im: dict):
    from megarl.rollout.types import PromptImages

    return PromptImages(im.get("pixel_values"), im.get("image_grid_thw"), im.get("pixel_values_videos"),
                        im.get("video_grid_thw"), im.get("second_per_grid_ts"))


def engine_batch(engine, kind: str, seed: int) -> StepBatch:
    """The engine's samples (the same on every rank: rank 0's) of the `kind` prompts, as a batch."""
    ids, images = prompts(kind)
    samples = from_rank0(engine.generate(ids, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed),
                                         images=images))
    return StepBatch.from_trajectories([
        Trajectory(uid=str(s.index), prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                   rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, routed_experts=s.routed_experts,
                   **trajectory_images(s.images)) for s in samples])


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    d = ((a - b).abs() * mask).max().reshape(1).to(device())
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def copy(batch: StepBatch, cfg) -> StepBatch:
    out = batch.select(list(range(len(batch))))
    rl.set_masks(out, cfg)
    return out


def run_layout(cfg, path, hf_config, batches: dict, tp: int, ep: int) -> dict:
    init_distributed(ParallelSizes(tp=tp, ep=ep), seed=3)
    model = train_model(hf_config, cfg.actor, path, model_options={"sequence_parallel": tp > 1},
                        logprob_chunk_tokens=7, routing_replay=True, track_routing=True)
    out, ready = {}, {}
    for name, batch in batches.items():  # the engine's weights: replay and agreement, engine == trainer
        b = copy(batch, cfg)
        b.old_logprobs = rl.compute_log_probs(model, b, 1.0)
        out[name] = {"logprob_diff": masked_max(b.old_logprobs, b.rollout_logprobs, b.response_mask),
                     "tokens": int(b.response_mask.sum()), "microbatches": len(model.microbatches(b)),
                     **model.routing_metrics}
        b.old_logprobs = b.old_logprobs + 0.3 * torch.sin(torch.arange(b.width)) * b.response_mask
        b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(4)) * b.response_mask
        ready[name] = b
    for step, (name, b) in enumerate(ready.items()):  # one PPO update on each batch
        m = dp_update(model, cfg, b, step)
        out[name].update(loss=m["actor/pg_loss"], grad_norm=m["actor/grad_norm"])
    engine = BuiltinEngine(hf_config.to_dict(), tokenizer=None)
    engine.update_weights(iter([list(streamed(model.modules, hf_config).items())]))
    after = copy(engine_batch(engine, "mixed", seed=11), cfg)
    after.old_logprobs = rl.compute_log_probs(model, after, 1.0)
    out["after_stream"] = {"logprob_diff": masked_max(after.old_logprobs, after.rollout_logprobs, after.response_mask),
                           "tokens": int(after.response_mask.sum()), **model.routing_metrics}
    return out


def freeze_vision(cfg, path, hf_config, batch) -> dict:
    init_distributed(ParallelSizes(tp=1, ep=2), seed=3)
    model = train_model(hf_config, cfg.actor, path, freeze_vision=True, routing_replay=True)
    before = streamed(model.modules, hf_config)
    b = copy(batch, cfg)
    b.old_logprobs = rl.compute_log_probs(model, b, 1.0) + 0.2 * b.response_mask
    b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(2)) * b.response_mask
    dp_update(model, cfg, b)
    after = streamed(model.modules, hf_config)
    visual = [k for k in before if k.startswith("model.visual.")]
    return {"visual": len(visual), "visual_changed": sum(not torch.equal(before[k], after[k]) for k in visual),
            "deepstack": sum("deepstack_merger_list" in k for k in visual),
            "lm_changed": sum(not torch.equal(before[k], after[k]) for k in before if k not in visual)}


def critic(cfg, path, hf_config, batch) -> dict:
    init_distributed(ParallelSizes(tp=2, ep=1), seed=3)
    model = train_model(hf_config, cfg.critic, path, value_head=True, model_options={"sequence_parallel": True},
                        logprob_chunk_tokens=7)
    b = copy(batch, cfg)
    values = rl.compute_values(model, b)
    zeroed = b.select(list(range(len(b))))
    zeroed.images = [None if im is None else type(im)(im.pixel_values, im.image_grid_thw,
                                                      torch.zeros_like(im.pixel_values_videos), im.video_grid_thw)
                     for im in b.images]
    out = {"finite": bool(torch.isfinite(values).all()),
           "zero_pixels_diff": masked_max(values, rl.compute_values(model, zeroed), b.response_mask)}
    b.values, b.returns = values, values + b.response_mask
    out["update"] = dp_update(model, cfg, b, critic=True)
    out["moved"] = masked_max(rl.compute_values(model, b), values, b.response_mask)
    return out


def video_logits(root) -> dict:
    """Megatron (TP2; the MoE at EP2) vs HF logits of two rows with videos (Qwen2.5-VL: frame
    spacing within the spatial span, where HF 5.19 and the original placement agree)."""
    from megarl.models.vision.forward import vlm_forward_logits
    from tests.distributed.scripts_models_common import loaded

    out = {}
    for family, layout in (("moe", (1, 2)), ("dense", (2, 1)), ("qwen2_5_vl", (2, 1))):
        q3 = family != "qwen2_5_vl"
        (a, ima), (b, imb) = (make_prompt([(20, 20)], video=(2, 6, 8), seed=1, frame_runs=q3),
                              make_prompt(video=(3, 8, 8), seed=2, frame_runs=q3))
        width = max(len(a), len(b))
        ids = torch.tensor([a + [5] * (width - len(a)), b + [7] * (width - len(b))])
        videos = dict(pixel_values_videos=torch.cat([ima["pixel_values_videos"], imb["pixel_values_videos"]]),
                      video_grid_thw=torch.cat([ima["video_grid_thw"], imb["video_grid_thw"]]))
        seconds = torch.tensor([0.5, 0.25])
        path = root / family
        with torch.no_grad():
            hf = hf_model(path) if q3 else transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32).eval()
            extra = {} if q3 else {"second_per_grid_ts": seconds}
            ref = hf(input_ids=ids, mm_token_type_ids=mm_types(ids), pixel_values=ima["pixel_values"],
                     image_grid_thw=ima["image_grid_thw"], **videos, **extra).logits
        init_distributed(ParallelSizes(tp=layout[0], ep=layout[1]), seed=3)
        model = loaded(transformers.AutoConfig.from_pretrained(path), path)
        got = vlm_forward_logits(model, ids, ima["pixel_values"], ima["image_grid_thw"], videos["pixel_values_videos"],
                                 videos["video_grid_thw"], None if q3 else seconds)
        out[family] = {"max_abs_diff": float((got - ref).abs().max()), "ref_std": float(ref.std()),
                       "video_tokens": int((ids == 151).sum())}
    return out


def main():
    from tests.distributed.scripts_vlm_common import make_tiny_vlm

    a = parse_args()
    root = a.root
    init_distributed(ParallelSizes(), seed=3)

    def files():
        make_tiny_qwen3_vl(root / "moe", seed=1)
        make_tiny_qwen3_vl(root / "dense", seed=2, moe=False)
        make_tiny_vlm(root / "qwen2_5_vl", seed=3)

    on_rank0(files)
    res = {"video_logits": video_logits(root), "layouts": {}, "seconds": {"video_logits": time.time() - START}}
    cfg = load_config(None, ["actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.clip_grad=0.05",
                             "actor.max_tokens_per_microbatch=96", "critic.lr=1e-2", "critic.lr_warmup_steps=0",
                             "critic.max_tokens_per_microbatch=96", "algorithm.entropy_coef=0.01",
                             "data.max_prompt_len=80", "rollout.max_new_tokens=8"])
    for family in ("moe", "dense"):
        path = root / family
        hf_config = transformers.AutoConfig.from_pretrained(path)
        engine = BuiltinEngine.from_pretrained(path, tokenizer=None)
        batches = {"images": engine_batch(engine, "images", 3), "video": engine_batch(engine, "video", 5)}
        res["layouts"][family] = {f"tp{tp}_ep{ep}": run_layout(cfg, path, hf_config, batches, tp, ep)
                                  for tp, ep in LAYOUTS[family]}
        res["seconds"][family] = time.time() - START
        if family == "moe":
            res["freeze_vision"] = freeze_vision(cfg, path, hf_config, batches["images"])
            res["critic"] = critic(cfg, path, hf_config, batches["video"])
    res["seconds"]["end"] = time.time() - START
    finish(a.out, res)


if __name__ == "__main__":
    main()
