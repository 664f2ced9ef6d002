"""Worker for tests/distributed/test_tppo.py (2 gloo ranks, one launch, several cases).

1. mismatch: the builtin engine samples responses from the HF weights; the trainer built at
   TP=1 (DP=2), TP=2 and PP=2 from the same weights recomputes their log-probs ->
   `rl.logprob_mismatch` per layout (the regression gate bounds it).
2. tppo: the RL loop with T-PPO windows run 4 steps straight, and 2 steps + resume to 4 in
   another run dir -> metrics.jsonl rows of both, and the in-flight samples of the step-2
   checkpoint (read back with torch.load(weights_only=True)).
"""

from pathlib import Path

import torch
import torch.distributed as dist

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.rollout import SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.trainer import checkpoint, rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import load_hf_config_and_tokenizer
from megarl.trainer.train_model import TrainModel
from tests.distributed.harness import dp_share, finish, metrics_rows, parse_args, train_run

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def engine_batch(hf_dir: str, temperature: float) -> StepBatch:
    """12 sampled responses (fixed seed: the same on every rank and layout) with the engine's log-probs."""
    engine = BuiltinEngine.from_pretrained(hf_dir)
    prompts = [[40 + i, 43, 50 + 2 * i, 61, 63] for i in range(6)]
    samples = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=16, seed=5))
    return StepBatch.from_trajectories([
        Trajectory(uid=str(s.index), prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                   rollout_logprobs=s.logprobs, finish_reason=s.finish_reason) for s in samples])


def case_mismatch(cfg, hf_config) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.weights import load_hf_weights

    out = {}
    for tp, pp in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=3)
        model = TrainModel(hf_config, cfg.actor, dtype="fp32")
        load_hf_weights(model.chunks, cfg.model.hf_path)
        batch = engine_batch(cfg.model.hf_path, cfg.rollout.temperature)
        local = batch.select(dp_share(batch)[0])
        local.old_logprobs = rl.compute_log_probs(model, local, cfg.rollout.temperature)
        out[f"tp{tp}_pp{pp}"] = {**rl.logprob_mismatch(local, ps.get_data_parallel_group()),
                                 "tokens": int(batch.response_mask.sum())}
    return out


def case_tppo(cfg_path: str, overrides: list[str], root: Path) -> dict:
    train_run(cfg_path, overrides, root / "straight", 4)
    train_run(cfg_path, overrides, root / "resumed", 2)
    latest = checkpoint.read_latest(root / "resumed")
    state = torch.load(latest / "trainer_state.pt", weights_only=True)
    saved = {r: torch.load(latest / "rows" / f"rank{r}.pt", weights_only=True)["rows"]
             for r in range(dist.get_world_size())}  # each rank's carried payloads, by key
    train_run(cfg_path, overrides, root / "resumed", 4, resume=True)
    if dist.get_rank() != 0:
        return {}
    return {"straight": metrics_rows(root / "straight"), "resumed": metrics_rows(root / "resumed"),
            "checkpoint_step": state["step"], "in_flight": state["in_flight"],
            "payloads": [{"response_ids": saved[m["source"]][m["key"]]["response_ids"],
                          "finish_reason": saved[m["source"]][m["key"]]["finish_reason"]} for m in state["in_flight"]],
            "saved_rows": sum(len(v) for v in saved.values())}


def main():
    a = parse_args(config=True)
    hf_config, _ = load_hf_config_and_tokenizer(a.cfg.model.hf_path)
    res = {"mismatch": case_mismatch(a.cfg, hf_config)}
    res["tppo"] = case_tppo(a.config, a.overrides, a.root)
    finish(a.out, res)


if __name__ == "__main__":
    main()
