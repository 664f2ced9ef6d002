"""Worker for tests/distributed/test_pag.py (2 gloo ranks, TP=2, the PAG preset).

A tiny model gets a short SFT on fixed turn texts (solution "Answer: <n>", verification "The answer
is wrong", revision "Answer: <n>"), so that its sampled trajectories take all three turns. Then:

1. components: the trainer's own components collect one step of PAG rollouts (builtin engine after
   a weight stream from the TP=2 actor); the actor recomputes their log-probs -> per trajectory the
   response ids, template / loss / value masks, turn layout, engine and trainer log-probs.
2. loop: `megarl.trainer.loop.train` runs 2 PAG steps -> the metrics.jsonl rows.
"""

import json
from pathlib import Path

import torch

from megarl.parallel.distributed import init_distributed
from tests.distributed.harness import finish, metrics_rows, on_rank0, parse_args


def write_sft_rows(path: Path, verify: str, revise: str, n: int = 96) -> None:
    from megarl.data.templates import apply_template
    from megarl.rollout.multi_turn import VERDICT_WRONG
    from megarl.tasks.tiny_model import EOS_TOKEN

    rows = []
    for i in range(n):
        a, b = 10 + i % 37, 20 + (7 * i) % 41
        prompt, answer = apply_template("arith", f"{a}+{b}"), f"Answer: {a + b}"
        rows += [{"prompt": prompt, "response": answer},
                 {"prompt": prompt + answer + EOS_TOKEN + verify, "response": VERDICT_WRONG},
                 {"prompt": prompt + answer + EOS_TOKEN + verify + VERDICT_WRONG + EOS_TOKEN + revise,
                  "response": answer}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def case_components(cfg) -> dict:
    from megarl.trainer import rl
    from megarl.trainer.components import build_components
    from megarl.trainer.step_collector import step_collector
    from megarl.trainer.state import TrainerState

    run = build_components(cfg)
    run.start_engine()
    run.sync_weights(0)
    with run.generation(release=True):
        rows, metrics = step_collector(cfg, run)(0, TrainerState())
    local, _, _ = run.take_rows(rows, 0, TrainerState())  # this DP rank's rows, as the loop gets them
    rl.set_masks(local, cfg)
    local.old_logprobs = rl.compute_log_probs(run.actor, local, cfg.rollout.temperature)
    out = {"metrics": metrics, "mismatch": rl.logprob_mismatch(local, run.dp_group), "trajectories": []}
    for i in range(len(local)):
        n = len(local.response_ids[i])
        out["trajectories"].append({
            "response_ids": local.response_ids[i], "template_mask": local.template_mask[i, :n].int().tolist(),
            "turn_ends": local.turn_ends[i], "turn_is_policy": local.turn_is_policy[i],
            "turn_outcome": local.turn_outcome[i], "engine_logprobs": local.rollout_logprobs[i, :n].tolist(),
            "trainer_logprobs": local.old_logprobs[i, :n].tolist(),
            "loss_mask": local.loss_mask[i, :n].tolist(), "value_mask": local.value_mask[i, :n].tolist(),
        })
    return out


def main():
    a = parse_args(config=True)
    root, cfg = a.root, a.cfg
    g = cfg.algorithm.pag
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    on_rank0(write_sft_rows, Path(cfg.sft.data_path), g.verify_instruction, g.revise_instruction)

    from megarl.trainer.loop import train
    from megarl.trainer.sft import sft

    cfg.model.load = sft(cfg, save_to=str(root / "sft_actor"))["checkpoint"]
    res = {"components": case_components(cfg), "instructions": [g.verify_instruction, g.revise_instruction]}
    cfg.trainer.run_dir = str(root / "loop")
    train(cfg)
    res["loop"] = metrics_rows(root / "loop")
    finish(a.out, res)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
