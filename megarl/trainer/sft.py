"""Supervised fine-tuning on the actor code path (`megarl sft`): token-mean NLL of the response
tokens over each global batch, through the same packed micro-batches, DDP and optimizer as RL.

Data: JSONL rows with `prompt` and `response` strings (the response gets the tokenizer's EOS).
Vision-language models: rows may carry images (`data.image_key`, placeholders as in prompt rows,
megarl.data.images), processed to pixels at load. Rows that are not valid JSON / UTF-8, lack a
field, have an unusable image, or exceed sft.max_len tokens are skipped and counted with their
row numbers.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl.parallel.distributed import init_distributed
from megarl.trainer import build, rl
from megarl.trainer.batch import MicroBatch, StepBatch, Trajectory
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.progress import Progress

log = logging.getLogger(__name__)


def load_sft_rows(path: str, tokenizer, max_len: int, images=None,
                  image_key: str = "images") -> tuple[list[Trajectory], list[tuple[int, str]]]:
    """(rows, skipped (row number, reason)); `images`: an ImageInputs (vision-language models)."""
    from megarl.data.images import ImageError

    rows, skipped = [], []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sft.data_path: {path} does not exist")
    eos = tokenizer.eos_token_id
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                row = json.loads(raw.decode("utf-8"))
                prompt, response = row["prompt"], row["response"]
                if not isinstance(prompt, str) or not isinstance(response, str) or not response:
                    raise ValueError("prompt/response must be non-empty strings")
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                skipped.append((n, f"{type(e).__name__}: {e}"))
                continue
            try:
                p_ids, pixels = _prompt_ids(row, prompt, tokenizer, images, image_key, p.parent)
            except ImageError as e:
                skipped.append((n, f"ImageError: {e}"))
                continue
            r_ids = tokenizer.encode(response, add_special_tokens=False) + ([eos] if eos is not None else [])
            if len(p_ids) + len(r_ids) > max_len or not p_ids:
                skipped.append((n, f"length {len(p_ids) + len(r_ids)} > sft.max_len {max_len} or empty prompt"))
                continue
            rows.append(Trajectory(uid=str(n), prompt_ids=p_ids, response_ids=r_ids, rollout_logprobs=[],
                                   finish_reason="stop", **pixels))
    if skipped:
        log.warning("%s: skipped %d bad rows, e.g. %s", path, len(skipped), skipped[:3])
    if not rows:
        raise ValueError(f"{path}: no usable SFT rows ({len(skipped)} skipped)")
    return rows, skipped


def _prompt_ids(row: dict, prompt: str, tokenizer, images, image_key: str, base_dir: Path) -> tuple[list[int], dict]:
    """(prompt ids, Trajectory image fields): the row's images' and videos' pads expanded and their pixels."""
    visuals = images.row_visuals(row, image_key) if images is not None else None
    if visuals is None:
        return tokenizer.encode(prompt, add_special_tokens=False), {}
    refs = images.refs(visuals, base_dir)
    counts = images.check(refs)
    ids = images.expand(tokenizer.encode(images.with_markers(prompt, refs), add_special_tokens=False), counts)
    pix = images.pixels(refs)
    return ids, {"pixel_values": pix.pixel_values, "image_grid_thw": pix.image_grid_thw,
                 "videos": pix.video_fields() or None}


def nll_loss_fn(counts: dict[str, float]):
    def loss_fn(mb: MicroBatch, logits):
        logp = mb.log_probs(logits)
        loss = -(logp * mb.data.loss_mask).sum() / counts["tokens"]
        return loss, {"sft/nll": loss.detach()}

    return loss_fn


def sft_run_config(cfg: MegaRLConfig, n_rows: int, max_steps: int | None = None):
    """The config SFT trains the actor with: a copy whose actor optimizer takes sft.lr with
    sft.lr_warmup_steps (constant afterwards) and whose trainer.total_steps is the SFT step count:
    `max_steps` (or sft.max_steps), else sft.epochs passes of n_rows // sft.batch_size steps."""
    cfg = copy.deepcopy(cfg)  # the SFT settings must not leak into the caller's RL config
    cfg.actor.lr, cfg.actor.lr_warmup_steps, cfg.actor.lr_decay_style = cfg.sft.lr, cfg.sft.lr_warmup_steps, "constant"
    max_steps = max_steps if max_steps is not None else cfg.sft.max_steps
    steps_per_epoch = max(1, n_rows // cfg.sft.batch_size)
    cfg.trainer.total_steps = steps_per_epoch * cfg.sft.epochs if max_steps is None else max_steps
    return cfg


def sft(cfg: MegaRLConfig, max_steps: int | None = None, save_to: str | None = None) -> dict:
    """Runs SFT; saves the actor (model only) as a torch_dist checkpoint at `save_to`
    (default run_dir/sft_actor). Returns {"steps", "final_nll", "checkpoint"}."""
    from megatron.core import parallel_state as ps

    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    rows, skipped = load_sft_rows(cfg.sft.data_path, tokenizer, cfg.sft.max_len,
                                  build.image_inputs(cfg, hf_config, tokenizer), cfg.data.image_key)
    cfg = sft_run_config(cfg, len(rows), max_steps)
    total = cfg.trainer.total_steps
    actor = build.build_actor(cfg, hf_config)
    dp_group, dp_rank, dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    logger = MetricsLogger(Path(cfg.trainer.run_dir) / "sft", cfg=cfg, job="sft")
    progress = Progress("SFT", total=total, enabled=dist.get_rank() == 0)
    rng = random.Random(cfg.trainer.seed)
    order: list[int] = []
    nll = float("nan")
    for step in range(total):
        if len(order) < cfg.sft.batch_size:
            fresh = list(range(len(rows)))
            rng.shuffle(fresh)
            order += fresh
        batch = StepBatch.from_trajectories([rows[i] for i in order[: cfg.sft.batch_size]])
        del order[: cfg.sft.batch_size]
        batch.loss_mask = batch.response_mask
        local = rl.split_minibatches(batch.lengths, len(batch), step, dp_rank, dp_size)[0]
        counts = rl.global_counts(batch, local, dp_group, batch.loss_mask)
        actor.set_lr(step)
        metrics = actor.train_step(batch, nll_loss_fn(counts), local)
        nll = metrics["sft/nll"]
        if not torch.isfinite(torch.tensor(nll)):
            raise FloatingPointError(f"SFT step {step}: NLL is {nll}; stopping without saving")
        logger.log(step + 1, {**metrics, "sft/skipped_rows": len(skipped)})
        progress.update(step + 1, nll=nll)
    progress.close()
    logger.close()
    out = save_to or str(Path(cfg.trainer.run_dir) / "sft_actor")
    if dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    actor.optimizer = None  # save the model only: RL starts a fresh optimizer
    actor.save(out)
    return {"steps": total, "final_nll": nll, "checkpoint": out}
