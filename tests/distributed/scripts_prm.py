"""Worker for tests/distributed/test_prm.py (2 gloo ranks, TP=2, the code_lines quickstart config).

A tiny model gets a short SFT on code_lines, then `ensure_prm` labels its responses by binary search
(real builtin engines on both ranks, real sandbox unit tests) and trains + saves the PRM. Then the
RL critic is built as the trainer builds it with prm.init_critic (and, for contrast, from the
actor), and the PRM as the RL loop's PrmScorer; their values and the scorer's dense rewards on a
batch of reference responses are reported.
"""

import json
from pathlib import Path

import torch

from megarl.parallel.distributed import init_distributed
from tests.distributed.harness import finish, parse_args


def main():
    a = parse_args(config=True, sft_steps=40)
    cfg = a.cfg
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)

    from megarl.trainer import build, rl
    from megarl.trainer.batch import StepBatch, Trajectory
    from megarl.trainer.prm import PrmScorer, ensure_prm
    from megarl.trainer.sft import sft

    out = sft(cfg, max_steps=a.sft_steps, save_to=str(Path(cfg.prm.path).parent / "sft"))
    cfg.model.load = out["checkpoint"]
    stats = ensure_prm(cfg)
    again = ensure_prm(cfg)  # a complete PRM at prm.path is reused, not retrained
    loaded_from = cfg.model.load
    cfg.model.load = str(Path(loaded_from).parent / "another_policy")
    try:  # ... but not for another policy (another run's SFT)
        ensure_prm(cfg)
        other_policy_error = ""
    except ValueError as e:
        other_policy_error = str(e)
    cfg.model.load = loaded_from

    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    rows = [json.loads(s) for s in Path(cfg.sft.data_path).read_text().splitlines()[:6]]
    eos = tokenizer.eos_token_id
    batch = StepBatch.from_trajectories([
        Trajectory(str(i), tokenizer.encode(r["prompt"]), tokenizer.encode(r["response"]) + [eos], [], "stop",
                   score=float(i % 2), acc=bool(i % 2)) for i, r in enumerate(rows)])
    actor = build.build_actor(cfg, hf_config, optim=False)
    scorer = PrmScorer(cfg, hf_config, tokenizer)
    prm_values = rl.compute_values(scorer.model, batch)
    critic = build.build_critic(cfg, hf_config, actor)
    cfg.prm.init_critic = False
    plain_critic = build.build_critic(cfg, hf_config, actor)
    dense = scorer.dense_rewards(batch)
    from megarl.trainer.components import _prm_scorer

    with_dense = _prm_scorer(cfg, hf_config, tokenizer) is not None  # the RL components build it with prm.dense_reward
    cfg.prm.dense_reward = False
    without_dense = _prm_scorer(cfg, hf_config, tokenizer) is not None
    res = {
        "stats": stats, "reused": again == stats, "other_policy_error": other_policy_error,
        "critic_vs_prm_max_diff": float((rl.compute_values(critic, batch) - prm_values).abs().max()),
        "actor_critic_vs_prm_max_diff": float((rl.compute_values(plain_critic, batch) - prm_values).abs().max()),
        "response_ids": batch.response_ids, "acc": batch.acc.tolist(),
        "prm_values": prm_values.tolist(), "dense": dense.tolist(), "newline_ids": sorted(scorer.newline_ids),
        "scorer_with_dense_reward": with_dense, "scorer_without_dense_reward": without_dense,
    }
    finish(a.out, res)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
