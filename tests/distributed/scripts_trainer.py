"""Worker for tests/distributed/test_trainer.py (2 gloo ranks, one launch, several cases).

1. layouts: the same fixed PPO batch trained 2 steps at TP=1 (DP=2), TP=2 and PP=2 (1F1B)
   from the same HF weights -> losses and grad norms per layout.
2. resume: the RL loop (PPO preset: critic, GAE) run 3 steps straight, and 2 steps + resume to
   3 in another run dir -> metrics.jsonl rows of both.
3. nan: a NaN advantage makes the actor update raise, and `latest` still names the last good
   checkpoint, which loads.
"""

import random
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.trainer import checkpoint, rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import load_hf_config_and_tokenizer
from megarl.trainer.train_model import TrainModel
from tests.distributed.harness import dp_update, finish, metrics_rows, parse_args, train_model, train_run


def fixed_batch(vocab: int, cfg, n: int = 8) -> StepBatch:
    rng = random.Random(0)
    trajs, advantages = [], []
    for i in range(n):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        r = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
        trajs.append(Trajectory(uid=str(i // 4), prompt_ids=p, response_ids=r, rollout_logprobs=[0.0] * len(r),
                                finish_reason="stop", score=float(i % 3 == 0), acc=i % 3 == 0))
        advantages.append([rng.uniform(-1, 1) for _ in r])
    batch = StepBatch.from_trajectories(trajs)
    batch.advantages = torch.zeros_like(batch.response_mask)
    for i, a in enumerate(advantages):
        batch.advantages[i, : len(a)] = torch.tensor(a)
    rl.set_masks(batch, cfg)
    return batch


def train_two_steps(model, cfg, batch) -> tuple[list[float], list[float]]:
    metrics = [dp_update(model, cfg, batch, step) for step in range(2)]
    return [m["actor/pg_loss"] for m in metrics], [m["actor/grad_norm"] for m in metrics]


def case_layouts(cfg, hf_config) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {}
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=3)
        model = train_model(hf_config, cfg.actor, cfg.model.hf_path)
        batch = fixed_batch(hf_config.vocab_size, cfg)
        batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
        # make the clip active on some tokens
        batch.old_logprobs += 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
        losses, norms = train_two_steps(model, cfg, batch)
        out[f"tp{tp}_pp{pp}"] = {"losses": losses, "grad_norms": norms,
                                 "schedule": get_forward_backward_func().__name__}
    return out


def case_resume(cfg_path: str, overrides: list[str], root: Path) -> dict:
    train_run(cfg_path, overrides, root / "straight", 3)
    train_run(cfg_path, overrides, root / "resumed", 2)
    train_run(cfg_path, overrides, root / "resumed", 3, resume=True)
    if dist.get_rank() != 0:
        return {}
    return {"straight": metrics_rows(root / "straight"), "resumed": metrics_rows(root / "resumed")}


def case_nan(cfg, hf_config, root: Path) -> dict:

    init_distributed(ParallelSizes(tp=2), seed=3)
    latest = checkpoint.read_latest(root / "resumed")
    model = TrainModel(hf_config, cfg.actor, dtype="fp32")
    model.load(str(latest / "actor"))
    batch = fixed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    batch.advantages[0, 0] = float("nan")
    error = ""
    try:
        train_two_steps(model, cfg, batch)
    except FloatingPointError as e:
        error = str(e)
    after = checkpoint.read_latest(root / "resumed")
    model.load(str(after / "actor"))  # still loadable
    return {"error": error, "latest_before": str(latest), "latest_after": str(after)}


def main():
    a = parse_args(config=True)
    hf_config, _ = load_hf_config_and_tokenizer(a.cfg.model.hf_path)
    res = {"layouts": case_layouts(a.cfg, hf_config)}
    res["resume"] = case_resume(a.config, a.overrides, a.root)
    res["nan"] = case_nan(a.cfg, hf_config, a.root)
    finish(a.out, res)


if __name__ == "__main__":
    main()
