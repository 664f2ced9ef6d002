"""Worker for tests/distributed/test_critic_learns.py (2 gloo ranks, TP=2).

A critic built as the trainer builds it (`build.build_critic`: the actor's backbone plus a value
head) is trained through the trainer's own path (`rl.compute_values`, `rl.compute_advantages`,
`rl.update` with `rl.critic_loss_fn`, `rl.explained_variance`) on a synthetic task whose outcome
is a known function of the response: score = +1 if the FIRST response token is `A`, -1 if it is
`B` (each with probability 1/2), the remaining response tokens are noise. With the reward on the
last token and gamma = lambda = 1 the return at every response token is the score, so:

- the value of response token j >= 1 (the state before token j, which has seen token 0) can
  predict the return exactly;
- the value of response token 0 (the state before token 0: the prompt only) cannot: it must stay
  near the mean return, 0. A critic that sees the token it scores (value read one position too
  late) would predict it; one read a position too early could not predict token 1.

Reports, on a held-out batch: the explained variance, and per position the mean squared error
of the values against the returns and the mean |value|.
"""

import random
from pathlib import Path

import torch

from megarl.parallel.distributed import init_distributed
from megarl.trainer import build, rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import load_hf_config_and_tokenizer
from tests.distributed.harness import finish, parse_args

A_TOKEN, B_TOKEN = 40, 41


def synthetic_batch(vocab: int, n: int, seed: int, cfg) -> StepBatch:
    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        prompt = [rng.randrange(50, vocab) for _ in range(rng.randint(4, 7))]
        first = rng.choice([A_TOKEN, B_TOKEN])
        response = [first] + [rng.randrange(50, vocab) for _ in range(rng.randint(5, 9))]
        score = 1.0 if first == A_TOKEN else -1.0
        trajs.append(Trajectory(uid=str(i), prompt_ids=prompt, response_ids=response,
                                rollout_logprobs=[0.0] * len(response), finish_reason="stop",
                                score=score, acc=score > 0))
    batch = StepBatch.from_trajectories(trajs)
    rl.set_masks(batch, cfg)
    return batch


def prepare(critic, batch: StepBatch, cfg, dp_group) -> StepBatch:
    rows = list(range(len(batch)))
    batch.old_logprobs = torch.zeros_like(batch.response_mask)
    batch.values = rl.compute_values(critic, batch)
    rl.compute_advantages(batch, batch, rows, cfg, dp_group, 0.0, value_pretraining=True)
    return batch


def main():
    from megatron.core import parallel_state as ps

    a = parse_args(config=True, steps=40)
    cfg = a.cfg
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    hf_config, _ = load_hf_config_and_tokenizer(cfg.model.hf_path)
    actor = build.build_actor(cfg, hf_config)
    critic = build.build_critic(cfg, hf_config, actor)
    dp_group, vocab = ps.get_data_parallel_group(), hf_config.vocab_size
    history = []
    for step in range(a.steps):
        batch = prepare(critic, synthetic_batch(vocab, 32, seed=step, cfg=cfg), cfg, dp_group)
        history.append(rl.explained_variance(batch, dp_group)["critic/explained_variance"])
        critic.set_lr(step)
        rl.update(critic, batch, [list(range(len(batch)))], lambda c: rl.critic_loss_fn(cfg, c), dp_group,
                   batch.value_mask)
    held_out = prepare(critic, synthetic_batch(vocab, 64, seed=10_000, cfg=cfg), cfg, dp_group)
    m = held_out.value_mask.bool()
    err = (held_out.values - held_out.returns) ** 2
    res = {
        "ev_first": history[0], "ev_history": history,
        "ev_held_out": rl.explained_variance(held_out, dp_group)["critic/explained_variance"],
        "mse_token0": float(err[:, 0].mean()), "abs_value_token0": float(held_out.values[:, 0].abs().mean()),
        "mse_later": float(err[:, 1:][m[:, 1:]].mean()),
        "returns_token0": held_out.returns[:, 0].tolist(), "scores": held_out.score.tolist(),
    }
    res.update(critic_from_policy_checkpoint(cfg, hf_config, actor, a.root / "policy"))
    finish(a.out, res)


def critic_from_policy_checkpoint(cfg, hf_config, actor, path: Path) -> dict:
    """critic.init_from = a policy checkpoint (no value head): the critic's backbone equals that
    checkpoint's weights, not the actor's current ones (moved after the save)."""
    actor.save(str(path))
    saved = {n: p.detach().clone() for n, p in actor.modules[0].named_parameters()}
    with torch.no_grad():
        for p in actor.modules[0].parameters():
            p.add_(0.01)
    cfg.critic.init_from = str(path)
    critic = build.build_critic(cfg, hf_config, actor)
    mine = dict(critic.modules[0].named_parameters())
    shared = [n for n in saved if n in mine and not n.startswith("output_layer")]
    return {"init_from_tensors": len(shared),
            "init_from_max_diff_to_checkpoint": max(float((mine[n] - saved[n]).abs().max()) for n in shared),
            "init_from_min_diff_to_actor": min(float((mine[n] - saved[n] - 0.01).abs().max()) for n in shared),
            "init_from_has_value_head": mine["output_layer.weight"].shape[0] == 1}


if __name__ == "__main__":
    main()
