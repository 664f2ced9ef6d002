"""The worker side of the distributed tests: what every script under tests/distributed does around
its own checks, written once.

`launch.run_worker` starts a worker under torchrun as `script --out FILE --root DIR [--config FILE]
[own options] [config overrides]`. A worker reads that with `parse_args`, lets rank 0 write shared
files with `on_rank0`, and ends with `finish`: rank 0 writes the JSON result, then every rank waits
at a barrier. The rest are small pieces several workers need: rank 0's objects on every rank, the
metrics rows of a run, an RL run of the trainer's loop, a trainer model loaded from HF files, and
one update on this DP rank's rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

# one GRPO step of the RL loop at TP=2 with sequence parallelism: no critic, eval or checkpoint
GRPO_STEP = ["rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4", "algorithm.mini_batch_size=8",
             "model.dtype=fp32", "model.transformer_impl=local", "model.sequence_parallel=true",
             "rollout.max_new_tokens=6", "actor.lr_warmup_steps=0", "parallel.tp=2", "parallel.nodes=1",
             "algorithm.dynamic_sampling=false", "algorithm.kl_coef=0.0", "critic.enable=false",
             "algorithm.advantage=grpo", "trainer.save_interval=0", "trainer.eval_interval=0", "data.eval=[]"]


def parse_args(config: bool = False, **options) -> argparse.Namespace:
    """The worker's command line: --out (where rank 0 writes the JSON result) and --root (the work
    folder, as a Path). With config=True: --config (optional) and the config overrides after it,
    loaded into `.cfg`. Each keyword is one more option with its default (its type too):
    sft_steps=40 is `--sft-steps N`."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True, type=Path)
    for name, default in options.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    if config:
        p.add_argument("--config", default=None)
        p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if config:
        from megarl.config import load_config

        a.cfg = load_config(a.config, a.overrides)
    return a


def on_rank0(fn, *args, **kwargs) -> None:
    """Runs fn(*args, **kwargs) on rank 0 only (it writes files every rank reads: a model, task
    data), then waits until every rank is here."""
    if dist.get_rank() == 0:
        fn(*args, **kwargs)
    dist.barrier()


def finish(out: str | Path, res) -> None:
    """The end of every worker: rank 0 writes `res` as JSON to `out`, then every rank waits at a
    barrier, so none exits before the result is written."""
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def from_rank0(obj):
    """Rank 0's `obj` on every rank (e.g. rank 0's samples, for every rank to score)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def metrics_rows(run_dir: str | Path) -> list[dict]:
    """On rank 0 the rows of run_dir/metrics.jsonl (the trainer's loop writes them on rank 0);
    on other ranks [] (only rank 0's result is written)."""
    if dist.get_rank() != 0:
        return []
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_run(config: str | None, overrides: list[str], run_dir: str | Path, steps: int,
              resume: bool = False) -> None:
    """The RL loop (megarl.trainer.loop.train) with `overrides`, in run_dir up to step `steps`;
    resume=True continues from run_dir's latest checkpoint."""
    from megarl.config import load_config
    from megarl.trainer.loop import train

    train(load_config(config, overrides + [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
                                           f"trainer.resume={str(resume).lower()}"]))


def train_model(hf_config, optim, path: str | Path, **kwargs):
    """A megarl TrainModel (fp32 unless kwargs say otherwise) with the HF weights at path, its
    optimizer's own copy of the parameters reloaded from them."""
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import load_hf_weights

    model = TrainModel(hf_config, optim, **{"dtype": "fp32", **kwargs})
    load_hf_weights(model.chunks, path)
    model.optimizer.reload_model_params()
    return model


def dp_share(batch, step: int = 0) -> tuple[list[int], list]:
    """This DP rank's rows of `batch` (the mini-batch split seeded by `step`) and its mini-batches."""
    from megatron.core import parallel_state as ps

    from megarl.trainer import rl

    return rl.local_minibatches(rl.split_minibatches(batch.lengths, len(batch), step, ps.get_data_parallel_rank(),
                                                     ps.get_data_parallel_world_size()))


def dp_update(model, cfg, batch, step: int = 0, critic: bool = False) -> dict:
    """One rl.update of `model` on this DP rank's share of `batch` (`dp_share`): the policy loss at
    temperature 1 over the loss mask, or with critic=True the value loss over the value mask."""
    from megatron.core import parallel_state as ps

    from megarl.trainer import rl

    rows, mbs = dp_share(batch, step)
    local = batch.select(rows)
    loss = (lambda c: rl.critic_loss_fn(cfg, c)) if critic else (lambda c: rl.actor_loss_fn(cfg, c, 1.0))
    return rl.update(model, local, mbs, loss, ps.get_data_parallel_group(),
                     local.value_mask if critic else local.loss_mask)
