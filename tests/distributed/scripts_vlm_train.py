"""Worker (2 gloo ranks, TP=2 with sequence parallelism, strict device mode): the trainer's own path
for a vision-language actor and critic (megarl.trainer.batch packed micro-batches with M-RoPE ids
and the rows' pixels, TrainModel, rl.update), against the builtin engine after a weight stream.

A tiny random qwen2_5_vl (tests/distributed/scripts_vlm_common.py):
- one PPO update of the actor on trajectories with images (vision tower trainable), then the
  actor's weights streamed into a `BuiltinEngine`; the engine samples prompts with one image, two
  images and none, and the trainer's `rl.compute_log_probs` of those trajectories (several
  sequences with their images packed per micro-batch) is compared with the engine's log-probs;
- teeth: the trainer's log-probs with the pixels zeroed, or with 1-D positions for the image rows;
- `freeze_vision`: after an update the streamed `visual.*` tensors are unchanged, the LM changed;
- a vision-language critic (value head) computes values and takes an update; zeroed pixels move them;
- one RL step of the loop (`megarl.trainer.loop.train`, GRPO) on the vlm_count task from a tiny VLM
  saved like the quickstart's, whose train file also holds rows with a missing, a corrupt and a too
  large image: they are skipped, counted and named in the warning, the step trains on the rest.
"""

import dataclasses
import json
from pathlib import Path

import torch

from megarl.config import load_config
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import PromptImages, SamplingParams
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.train_model import TrainModel
from tests.distributed.harness import (
    GRPO_STEP, dp_update, finish, from_rank0, metrics_rows, on_rank0, parse_args, train_model, train_run)
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_vlm_common import IMAGE, make_prompt, shared_tiny_vlm


def prompts():
    made = [make_prompt([(20, 37)], 1), make_prompt([(48, 40), (9, 9)], 2), make_prompt([], 3),
            make_prompt([(16, 24)], 4)]
    return [m[0] for m in made], [None if m[1] is None else PromptImages(m[1]["pixel_values"], m[1]["image_grid_thw"])
                                  for m in made]


def model(cfg, hf_config, path, **kw) -> TrainModel:
    return train_model(hf_config, cfg.critic if kw.get("value_head") else cfg.actor, path,
                       model_options={"sequence_parallel": True}, logprob_chunk_tokens=7, **kw)


def trajectories(samples, images) -> list[Trajectory]:
    out = []
    for s in samples:
        im = images[s.index]
        out.append(Trajectory(uid=str(s.index), prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                              rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason,
                              pixel_values=None if im is None else im.pixel_values,
                              image_grid_thw=None if im is None else im.image_grid_thw))
    return out


def update(m: TrainModel, cfg, batch: StepBatch, critic: bool = False) -> dict:
    rl.set_masks(batch, cfg)
    return dp_update(m, cfg, batch, critic=critic)


def max_masked(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def _positions(mb) -> torch.Tensor:
    """[1, S] position of every token within its own sequence of the packed row."""
    cu = mb.cu_seqlens.tolist()
    return torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]


def with_pixels(batch: StepBatch, fn) -> StepBatch:
    out = batch.select(list(range(len(batch))))
    out.images = [None if im is None else PromptImages(fn(im.pixel_values), im.image_grid_thw) for im in batch.images]
    return out


def main():
    a = parse_args()
    init_distributed(ParallelSizes(tp=2, pp=1), seed=5)
    hf_dir = a.root / "hf"
    hf_config = shared_tiny_vlm(hf_dir)
    cfg = load_config(None, ["actor.lr=1e-2", "actor.lr_warmup_steps=0", "critic.lr=1e-2", "critic.lr_warmup_steps=0",
                             "actor.max_tokens_per_microbatch=160", "critic.max_tokens_per_microbatch=160",
                             "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0",
                             "data.max_prompt_len=100", "rollout.max_new_tokens=6"])
    ids, images = prompts()
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    res = {}

    # one actor update on engine trajectories with images, then stream, sample, compare
    actor = model(cfg, hf_config, hf_dir)
    before = streamed(actor.modules, hf_config)
    first = StepBatch.from_trajectories(trajectories(engine.generate(ids, sampling, images=images), images))
    first.old_logprobs = rl.compute_log_probs(actor, first, 1.0)
    res["pre_update_diff"] = max_masked(first.old_logprobs, first.rollout_logprobs, first.response_mask)
    first.advantages = torch.randn(first.response_mask.shape, generator=torch.Generator().manual_seed(1)) * first.response_mask
    res["update"] = update(actor, cfg, first)
    after = streamed(actor.modules, hf_config)
    res["visual_changed"] = sum(not torch.equal(before[k], after[k]) for k in before if k.startswith("visual."))
    res["n_visual"] = sum(k.startswith("visual.") for k in before)
    engine.update_weights([list(after.items())])
    samples = from_rank0(engine.generate(ids, sampling, images=images))  # both ranks score rank 0's samples
    batch = StepBatch.from_trajectories(trajectories(samples, images))
    res["microbatches"] = len(actor.microbatches(batch))
    res["rows_with_images"] = sum(im is not None for im in batch.images)
    # a random policy may emit the placeholder id: the trainer embeds it as text, as the engine does
    res["responses_with_placeholder"] = sum(IMAGE in r for r in batch.response_ids)
    trainer = rl.compute_log_probs(actor, batch, 1.0)
    res["logprob_max_abs_diff"] = max_masked(trainer, batch.rollout_logprobs, batch.response_mask)
    res["n_tokens"] = int(batch.response_mask.sum())
    zeroed = rl.compute_log_probs(actor, with_pixels(batch, torch.zeros_like), 1.0)
    res["teeth_zero_pixels"] = max_masked(trainer, zeroed, batch.response_mask)
    # the same micro-batches with each sequence's plain 1-D positions instead of its M-RoPE ids
    flat = [dataclasses.replace(mb, position_ids=mb.position_ids[0] * 0 + _positions(mb)) for mb in actor.microbatches(batch)]
    actor.microbatches = lambda b, rows=None: flat
    res["teeth_1d_positions"] = max_masked(trainer, rl.compute_log_probs(actor, batch, 1.0), batch.response_mask)
    del actor.microbatches

    # freeze_vision: the tower stays as loaded, the LM trains
    frozen = model(cfg, hf_config, hf_dir, freeze_vision=True)
    f0 = streamed(frozen.modules, hf_config)
    batch.old_logprobs = rl.compute_log_probs(frozen, batch, 1.0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    res["frozen_update"] = update(frozen, cfg, batch)
    f1 = streamed(frozen.modules, hf_config)
    res["frozen_visual_changed"] = sum(not torch.equal(f0[k], f1[k]) for k in f0 if k.startswith("visual."))
    res["frozen_lm_changed"] = sum(not torch.equal(f0[k], f1[k]) for k in f0 if not k.startswith("visual."))
    res["frozen_trainable_visual"] = sum(p.requires_grad for c in frozen.modules for n, p in c.named_parameters()
                                         if n.startswith("vision_model."))

    # a vision-language critic
    critic = model(cfg, hf_config, hf_dir, value_head=True)
    values = rl.compute_values(critic, batch)
    res["values_finite"] = bool(torch.isfinite(values).all())
    res["values_zero_pixels_diff"] = max_masked(values, rl.compute_values(critic, with_pixels(batch, torch.zeros_like)),
                                                batch.response_mask)
    batch.values, batch.returns = values, values + batch.response_mask
    res["critic_update"] = update(critic, cfg, batch, critic=True)
    moved = rl.compute_values(critic, batch)
    res["critic_values_moved"] = max_masked(moved, values, batch.response_mask)
    res["rl_loop"] = rl_loop(a.root)
    finish(a.out, res)


def rl_loop(root: Path) -> dict:
    import logging

    import numpy as np
    from PIL import Image

    from megarl.tasks.tiny_vlm import save_tiny_vlm
    from megarl.tasks.vlm_count import write_task_files

    task = root / "task"

    def files():
        save_tiny_vlm(root / "tiny_vlm", seed=1)
        write_task_files(task, n_sft=2, n_train=8, n_eval=2, seed=0)
        Image.fromarray(np.zeros((256, 256, 3), dtype=np.uint8)).save(task / "images" / "huge.png")
        (task / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
        bad = [{"id": f"bad-{k}", "problem": "<image>\nHow many red squares?\n", "images": [f"images/{k}.png"],
                "answer": "1", "data_source": "vlm_count"} for k in ("missing", "broken", "huge")]
        with (task / "train.jsonl").open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in bad))

    on_rank0(files)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("megarl.data").addHandler(handler)
    overrides = [
        f"data.train_path={task / 'train.jsonl'}", "data.prompt_template=raw", "data.max_prompt_len=96",
        "data.max_image_tokens=40", "reward.sources={vlm_count: math}", f"model.hf_path={root / 'tiny_vlm'}",
        "actor.max_tokens_per_microbatch=256", "parallel.gpus_per_node=2", *GRPO_STEP,
    ]
    train_run(None, overrides, root / "run", 1)
    logging.getLogger("megarl.data").removeHandler(handler)
    return {"rows": metrics_rows(root / "run"), "warnings": [r for r in records if "unusable images" in r]}


if __name__ == "__main__":
    main()
