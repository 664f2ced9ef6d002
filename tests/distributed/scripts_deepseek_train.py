"""Worker for tests/distributed/test_deepseek_train.py (4 gloo ranks, one launch): training DeepSeek-V3
(multi-latent attention) and GLM-4.5 tiny models through the trainer.

Sections (rank 0 writes the JSON):
- layouts[family][tp{t}_ep{e}]: the same packed batch at TP1xEP1 (DP4), TP1xEP2 and TP2xEP2
  (sequence parallel): old log-probs, two clipped PPO updates (loss, grad norm), every streamed HF
  tensor after them against TP1xEP1's, and whether the selection biases moved;
- bias_rate: TP1xEP2 with model.moe_expert_bias_update_rate > 0 (megarl.trainer.build.model_options): the
  biases move after an update;
- replay[...]: the builtin engine's samples (routed experts of every layer recorded) recomputed by
  the trainer at TP2xEP2 with routing replay: engine vs trainer log-probs and the MoE metrics; with
  perturbed routers, without and with replay.
"""

import torch

from megarl.config import load_config
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.trainer import rl
from tests.distributed.harness import dp_update, finish, on_rank0, parse_args
from tests.distributed.scripts_deepseek import make_tiny, tiny_config
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_moe_train import actor, engine_batch, packed_batch, replay_case

LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (tp, ep); TP2 with sequence parallelism
FAMILIES = ("deepseek_v3", "glm4_moe")


def biases(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if k.endswith("e_score_correction_bias")}


def run_layout(cfg, hf_config, path, tp, ep, before: dict | None, **kw) -> tuple[dict, dict]:
    model = actor(cfg, hf_config, path, tp, ep, **kw)
    start = streamed(model.modules, hf_config)
    batch = packed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    out = {"old_logprobs": batch.old_logprobs.tolist(), "microbatches": len(model.microbatches(batch))}
    batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
    metrics = [dp_update(model, cfg, batch, step) for step in range(2)]
    out.update(losses=[m["actor/pg_loss"] for m in metrics], grad_norms=[m["actor/grad_norm"] for m in metrics])
    weights = streamed(model.modules, hf_config)
    b0, b1 = biases(start), biases(weights)
    out.update(n_biases=len(b1), biases_moved=sum(not torch.equal(b0[k], b1[k]) for k in b0))
    if before is not None:
        out["weights_max_rel_diff"] = max(float((weights[k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                                          for k, v in before.items())
        out["n_tensors"] = len(weights)
    return out, weights


def main():
    a = parse_args()
    root = a.root
    init_distributed(ParallelSizes(), seed=3)
    on_rank0(lambda: [make_tiny(fam, root / fam, seed=i) for i, fam in enumerate(FAMILIES)])
    cfg = load_config(None, ["actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.clip_grad=0.05",
                             "actor.max_tokens_per_microbatch=40", "algorithm.entropy_coef=0.01",
                             "data.max_prompt_len=16", "rollout.max_new_tokens=16"])
    res: dict = {"layouts": {f: {} for f in FAMILIES}, "replay": {}}
    for fam in FAMILIES:
        hf_config, ref = tiny_config(fam), None
        for tp, ep in LAYOUTS:
            out, weights = run_layout(cfg, hf_config, root / fam, tp, ep, ref)
            ref = weights if ref is None else ref
            res["layouts"][fam][f"tp{tp}_ep{ep}"] = out
    hf_config = tiny_config("deepseek_v3")
    path = root / "deepseek_v3"
    from megarl.trainer.build import model_options

    run = load_config(None, ["model.moe_expert_bias_update_rate=0.01"])  # through the trainer's own mapping
    res["bias_rate"], _ = run_layout(cfg, hf_config, path, 1, 2, None, model_options=model_options(run.model, run.parallel))
    samples = engine_batch(path)
    r = res["replay"]
    r["same_weights_tp2_ep2"] = replay_case(cfg, hf_config, path, samples, 2, 2, replay=True, perturb=0.0)
    r["perturbed_tp1_ep2_off"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=False, perturb=0.5,
                                             own_check=True)
    r["perturbed_tp2_ep2_on"] = replay_case(cfg, hf_config, path, samples, 2, 2, replay=True, perturb=0.5, train=True)
    r["routed_shape"] = list(samples.routed_experts[0].shape)
    finish(a.out, res)


if __name__ == "__main__":
    main()
