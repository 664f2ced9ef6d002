"""Worker for tests/distributed/test_cp.py (4 gloo ranks, one launch).

The same packed variable-length PPO batch (sequence lengths not multiples of 2*CP) at layouts
(tp, pp, cp) = (1, 1, 1) [DP 4], (1, 1, 2) [DP 2], (2, 1, 2), (1, 2, 2): old log-probs, critic
values, then two actor updates (loss, entropy, grad norm) and one critic update, from the same HF
weights. Then the RL loop (PPO preset: critic, GAE) for 2 steps at CP=2 x DP=2 with a checkpoint every
step, resumed for a third step at CP=1 x DP=4 (torch_dist reshards). Also, at CP=1: the chunked
response views (log-probs / entropy at chunk sizes 1 and 3)
against the unchunked ones, values and gradients.
"""

import random
from pathlib import Path

import torch

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.build import load_hf_config_and_tokenizer
from megarl.trainer.train_model import TrainModel
from tests.distributed.harness import dp_update, finish, metrics_rows, parse_args, train_model, train_run

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]


def packed_batch(vocab: int, cfg, n: int = 8, max_response: int = 23) -> StepBatch:
    """n random prompts (3-9 tokens) and responses (1..max_response tokens), random advantages
    and returns; the same batch on every rank."""
    rng = random.Random(1)
    trajs = []
    for i in range(n):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        r = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_response))]
        trajs.append(Trajectory(uid=str(i // 2), prompt_ids=p, response_ids=r, rollout_logprobs=[0.0] * len(r),
                                finish_reason="stop", score=float(i % 3 == 0), acc=i % 3 == 0))
    batch = StepBatch.from_trajectories(trajs)
    g = torch.Generator().manual_seed(2)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    rl.set_masks(batch, cfg)
    return batch


def run_layout(cfg, hf_config, tp, pp, cp) -> dict:
    init_distributed(ParallelSizes(tp=tp, pp=pp, cp=cp), seed=3)
    actor = train_model(hf_config, cfg.actor, cfg.model.hf_path, logprob_chunk_tokens=5)
    critic = TrainModel(hf_config, cfg.critic, value_head=True, dtype="fp32", seed=0, logprob_chunk_tokens=5)
    critic.copy_backbone_from(actor)
    batch = packed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(actor, batch, 1.0)
    batch.values = rl.compute_values(critic, batch)
    out = {"old_logprobs": batch.old_logprobs.tolist(), "values": batch.values.tolist(),
           "microbatches": len(actor.microbatches(batch))}
    batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
    metrics = [dp_update(actor, cfg, batch, step) for step in range(2)]
    m = dp_update(critic, cfg, batch, 1, critic=True)  # the rows of the last actor update
    out.update(losses=[x["actor/pg_loss"] for x in metrics], entropies=[x["actor/entropy"] for x in metrics],
               grad_norms=[x["actor/grad_norm"] for x in metrics],
               critic_loss=m["critic/value_loss"], critic_grad_norm=m["critic/grad_norm"])
    return out


def chunked_views(cfg, hf_config) -> dict:
    """CP=1, world of 4 as DP: response views at chunk sizes 1, 3 and 4096 on the same logits."""
    from megarl.trainer.batch import build_microbatch
    from megarl.models.attention import thd_params
    from megarl.weights import load_hf_weights

    init_distributed(ParallelSizes(), seed=3)
    model = TrainModel(hf_config, cfg.actor, dtype="fp32")
    load_hf_weights(model.chunks, cfg.model.hf_path)
    batch = packed_batch(hf_config.vocab_size, cfg)
    mb = build_microbatch(batch, list(range(len(batch))))
    gpt = model.modules[0]
    from megarl.parallel.distributed import device

    mb = mb.to(device())
    res = {}
    for chunk in (4096, 3, 1):
        mb.chunk_tokens = chunk
        logits = gpt(mb.input_ids, mb.position_ids, None, packed_seq_params=thd_params(mb.cu_seqlens))
        logp, ent = mb.log_probs(logits), mb.entropy(logits)
        (logp.sum() + 0.5 * ent.sum()).backward()
        grad = torch.cat([p.main_grad.reshape(-1) if hasattr(p, "main_grad") else p.grad.reshape(-1)
                          for p in gpt.parameters()])
        res[chunk] = {"logp": logp.cpu().tolist(), "ent": ent.cpu().tolist(), "grad_norm": float(grad.norm())}
        model.chunks[0].zero_grad_buffer()
    # an independent expectation: log_softmax / entropy of the gathered logits at the response positions
    with torch.no_grad():
        logits = gpt(mb.input_ids, mb.position_ids, None, packed_seq_params=thd_params(mb.cu_seqlens))[0].float().cpu()
        full = torch.log_softmax(logits, -1)
        logp = full.gather(-1, mb.targets.cpu()[0, :, None])[:, 0][mb.resp_index.cpu()]
        ent = torch.distributions.Categorical(logits=logits).entropy()[mb.resp_index.cpu()]
        mask = batch.response_mask
    res["reference"] = {"logp": (logp * mask).tolist(), "ent": (ent * mask).tolist()}
    return res


def rl_loop_cp2_then_resume_cp1(config: str, overrides: list[str], root: Path) -> dict:
    base = overrides + ["trainer.save_interval=1", "trainer.eval_interval=0", "data.max_prompt_len=32",
                        "rollout.max_new_tokens=12"]
    train_run(config, base + ["parallel.cp=2"], root / "run", 2)
    train_run(config, base + ["parallel.cp=1"], root / "run", 3, resume=True)
    return {"rows": metrics_rows(root / "run")}


def main():
    a = parse_args(config=True)
    hf_config, _ = load_hf_config_and_tokenizer(a.cfg.model.hf_path)
    res = {f"tp{tp}_pp{pp}_cp{cp}": run_layout(a.cfg, hf_config, tp, pp, cp) for tp, pp, cp in LAYOUTS}
    res["chunked"] = chunked_views(a.cfg, hf_config)
    res["loop"] = rl_loop_cp2_then_resume_cp1(a.config, a.overrides, a.root)
    finish(a.out, res)


if __name__ == "__main__":
    main()
