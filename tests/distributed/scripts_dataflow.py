"""Worker for tests/distributed/test_dataflow.py (2 gloo ranks): a tiny qwen3_moe whose expert
parallelism (EP=2) spans the two DP ranks, trained on batches where the DP ranks' micro-batch
counts differ ("uneven": 1 vs 2 under the token budget) or one DP rank has no rows ("empty"), at
EP=2 and at EP=1 (same DP=2, experts replicated): old log-probs, two updates (loss, grad norm) and the largest
relative difference of any streamed HF tensor afterwards. Collectives time out after 120 s, so a mismatch of all-to-all
counts fails instead of hanging for the default 30 minutes.
"""

from __future__ import annotations

import torch

from megarl.config import load_config
from megarl.data.packing import token_budget_microbatches
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from tests.distributed.harness import dp_share, dp_update, finish, on_rank0, parse_args, train_model
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_moe import make_tiny_moe

BUDGET = 16  # tokens per micro-batch
CASES = {"uneven": [30, 8, 8, 8, 8], "empty": [12]}  # sequence lengths (prompt 4 + response)


def batch_of(lengths: list[int], vocab: int, cfg) -> StepBatch:
    g = torch.Generator().manual_seed(7)
    trajs = [Trajectory(uid=str(i), prompt_ids=torch.randint(3, vocab, (4,), generator=g).tolist(),
                        response_ids=torch.randint(3, vocab, (n - 4,), generator=g).tolist(),
                        rollout_logprobs=[0.0] * (n - 4), finish_reason="stop", score=float(i % 2), acc=bool(i % 2))
             for i, n in enumerate(lengths)]
    batch = StepBatch.from_trajectories(trajs)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    rl.set_masks(batch, cfg)
    return batch


def run(cfg, hf_config, path, ep: int, lengths: list[int], reference: dict | None = None) -> tuple[dict, dict]:
    init_distributed(ParallelSizes(ep=ep), seed=3, timeout_s=120)
    model = train_model(hf_config, cfg.actor, path, logprob_chunk_tokens=5)
    model.max_tokens = BUDGET
    batch = batch_of(lengths, hf_config.vocab_size, cfg)
    rows, _ = dp_share(batch)
    own = len(token_budget_microbatches([batch.lengths[i] for i in rows], BUDGET)) if rows else 0
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    out = {"rows": rows, "own_microbatches": own, "old_logprobs": batch.old_logprobs.tolist()}
    batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
    metrics = [dp_update(model, cfg, batch, step=0) for _ in range(2)]
    out.update(losses=[m["actor/pg_loss"] for m in metrics], grad_norms=[m["actor/grad_norm"] for m in metrics])
    weights = streamed(model.modules, hf_config)
    if reference is not None:  # every HF tensor after the updates against the reference run's
        out["weights_max_rel_diff"] = max(float((weights[k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                                          for k, v in reference.items())
        out["moved"] = max(float((weights[k] - v).abs().max()) for k, v in reference.items())
    return out, weights


def main():
    a = parse_args()
    path = a.root / "moe"
    init_distributed(ParallelSizes(), timeout_s=120)
    on_rank0(make_tiny_moe, "qwen3_moe", path, seed=1)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    cfg = load_config(None, ["model.dtype=fp32", "algorithm.policy_loss=ppo", "algorithm.kl_coef=0.0",
                             "algorithm.entropy_coef=0.01", "actor.lr=1e-3", "actor.lr_warmup_steps=0",
                             "actor.clip_grad=0.05"])
    res = {}
    for case, lengths in CASES.items():
        res[f"{case}_ep1"], weights = run(cfg, hf_config, path, 1, lengths)
        res[f"{case}_ep2"], _ = run(cfg, hf_config, path, 2, lengths, weights)
    from tests.distributed.harness import gather

    finish(a.out, gather(res))


if __name__ == "__main__":
    main()
