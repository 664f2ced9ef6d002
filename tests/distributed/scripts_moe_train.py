"""Worker for tests/distributed/test_moe_train.py (4 gloo ranks, one launch): MoE training.

Sections (rank 0 writes the JSON):
- layouts[tp{t}_ep{e}]: the same packed batch at TP1xEP1 (DP4), TP1xEP2 and TP2xEP2 (sequence
  parallel, megarl's RMSNorm): old log-probs, two actor updates (loss, grad norm; gradient clipping
  active), and the max relative difference of every streamed HF tensor after the updates against
  TP1xEP1's;
- freeze: TP1xEP2 with model.freeze_router: routers bit-identical after an update, experts moved;
- replay[...]: engine samples (builtin engine, routed_experts recorded) recomputed by the trainer:
  engine vs trainer log-probs, the agreement metrics, and (TP1xEP2) what the routers used per
  token, read by this script's own hooks and compared with the engine's experts;
- loop: metrics.jsonl of one RL step of megarl.trainer.loop.train, tiny qwen3_moe at TP2xEP2 with
  routing replay.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.trainer import rl
from megarl.trainer.batch import StepBatch, Trajectory
from megarl.trainer.train_model import TrainModel
from tests.distributed import scripts_cp
from tests.distributed.harness import (
    GRPO_STEP, dp_update, finish, metrics_rows, on_rank0, parse_args, train_model, train_run)
from tests.distributed.scripts_models_common import streamed
from tests.distributed.scripts_moe import make_tiny_moe, tiny_moe_config

START = time.time()
LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (tp, ep); TP2 with sequence parallelism
PROMPTS = [[5, 9, 14, 3], [7, 7, 120, 33, 2, 64, 18], [100, 4], [11, 12, 13, 14, 15]]


def packed_batch(vocab: int, cfg) -> StepBatch:
    return scripts_cp.packed_batch(vocab, cfg, max_response=15)


def actor(cfg, hf_config, path, tp: int, ep: int, pp: int = 1, cp: int = 1, **kw) -> TrainModel:
    init_distributed(ParallelSizes(tp=tp, ep=ep, pp=pp, cp=cp), seed=3)
    options = {"sequence_parallel": tp > 1, **kw.pop("model_options", {})}
    return train_model(hf_config, cfg.actor, path, model_options=options, logprob_chunk_tokens=5, **kw)


def run_layout(cfg, hf_config, path, tp, ep, before: dict | None) -> tuple[dict, dict]:
    model = actor(cfg, hf_config, path, tp, ep)
    batch = packed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    out = {"old_logprobs": batch.old_logprobs.tolist(), "microbatches": len(model.microbatches(batch))}
    batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
    metrics = [dp_update(model, cfg, batch, step) for step in range(2)]
    out.update(losses=[m["actor/pg_loss"] for m in metrics], grad_norms=[m["actor/grad_norm"] for m in metrics])
    weights = streamed(model.modules, hf_config)
    if before is not None:
        out["weights_max_rel_diff"] = max(float((weights[k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                                          for k, v in before.items())
        out["n_tensors"] = len(weights)
    return out, weights


def freeze_router(cfg, hf_config, path) -> dict:
    model = actor(cfg, hf_config, path, 1, 2, freeze_router=True)
    before = streamed(model.modules, hf_config)
    batch = packed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0) + 0.2 * batch.response_mask
    m = dp_update(model, cfg, batch, 0)
    after = streamed(model.modules, hf_config)
    gate = [k for k in before if k.endswith("mlp.gate.weight")]
    experts = [k for k in before if ".mlp.experts." in k]
    return {"gates": len(gate), "gates_identical": all(torch.equal(before[k], after[k]) for k in gate),
            "experts_changed": sum(not torch.equal(before[k], after[k]) for k in experts), "experts": len(experts),
            "grad_norm": m["actor/grad_norm"],
            "router_params_trainable": sum(p.requires_grad for c in model.modules
                                           for n, p in c.named_parameters() if ".router." in n)}


def aux_loss(cfg, hf_config, path) -> dict:
    """First update's grad norm at TP1xEP2 with the load-balancing loss of model.moe_aux_loss_coeff /
    model.moe_load_balancing_type (megarl.trainer.build.model_options), the same batch as the layouts."""
    from megarl.trainer.build import model_options

    out = {}
    for kind in ("aux_loss", "global_aux_loss"):
        run = load_config(None, ["model.moe_aux_loss_coeff=0.5", f"model.moe_load_balancing_type={kind}"])
        model = actor(cfg, hf_config, path, 1, 2, model_options=model_options(run.model, run.parallel))
        batch = packed_batch(hf_config.vocab_size, cfg)
        batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
        batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
        out[kind] = dp_update(model, cfg, batch, 0)["actor/grad_norm"]
    return out


def dense_sequence_parallel(cfg, root: Path) -> dict:
    """A dense tiny Qwen2 on the local spec: TP2 with sequence parallelism vs TP1 (same updates)."""
    import transformers

    path = root / "dense"
    hf_config = transformers.Qwen2Config(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False)
    def save():
        torch.manual_seed(1)
        transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(path)

    on_rank0(save)
    out = {}
    for tp in (1, 2):
        model = actor(cfg, hf_config, path, tp, 1)
        out[f"tp{tp}_sequence_parallel"] = model.config.sequence_parallel
        batch = packed_batch(hf_config.vocab_size, cfg)
        batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
        batch.old_logprobs = batch.old_logprobs + 0.3 * torch.sin(torch.arange(batch.width)) * batch.response_mask
        m = [dp_update(model, cfg, batch, step) for step in range(2)]
        out[f"tp{tp}"] = {"losses": [x["actor/pg_loss"] for x in m], "grad_norms": [x["actor/grad_norm"] for x in m]}
    return out


def engine_batch(path) -> StepBatch:
    """Samples of the builtin engine (same on every rank: same weights, same seed), with their routing."""
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.types import SamplingParams

    engine = BuiltinEngine.from_pretrained(path, tokenizer=None)
    samples = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=5))
    trajs = [Trajectory(uid=str(s.index), prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                        rollout_logprobs=s.logprobs, finish_reason=s.finish_reason, routed_experts=s.routed_experts)
             for s in samples]
    return StepBatch.from_trajectories(trajs)


def perturb_routers(model, scale: float) -> None:
    """The same router noise on every rank (routers are replicated over TP / EP) and layout."""
    from megarl.models.routing import moe_routers

    with torch.no_grad():
        for c in model.modules:
            for layer, router in moe_routers(c):  # noise per global layer: the same under PP
                g = torch.Generator().manual_seed(11 + layer)
                router.weight.add_(scale * torch.randn(router.weight.shape, generator=g).to(router.weight.device))
    model.optimizer.reload_model_params()


def used_routing_fraction(model, local: StepBatch) -> list[float]:
    """This script's own reading (TP1, no SP, CP1): forward hooks record the routing map every router
    used per micro-batch; the fraction of (token, layer, slot) equal to the engine's experts over the
    tokens the engine forwarded (each sequence's packed offset from cu_seqlens). [agree, slots]."""
    from megarl.models.routing import moe_routers

    seen: list[tuple[int, torch.Tensor]] = []
    handles = [router.register_forward_hook(lambda m, a, out, i=i: seen.append((i, out[1].detach().cpu())))
               for c in model.modules for i, router in moe_routers(c)]
    rl.compute_log_probs(model, local, 1.0)
    for h in handles:
        h.remove()
    agree = slots = 0.0
    mbs = model.microbatches(local)
    layers = len(seen) // max(len(mbs), 1)
    for m_i, mb in enumerate(mbs):
        cu = mb.cu_seqlens.tolist()
        for layer, used in seen[m_i * layers:(m_i + 1) * layers]:
            for k, row in enumerate(mb.rows):
                n = len(local.prompt_ids[row]) + len(local.response_ids[row])
                engine = local.routed_experts[row][: n - 1, layer].long()
                mine = used[cu[k]: cu[k] + n - 1]
                agree += float(mine.gather(1, engine).sum())
                slots += engine.numel()
    return [agree, slots]


def replay_case(cfg, hf_config, path, batch: StepBatch, tp, ep, replay: bool, perturb: float,
                own_check: bool = False, train: bool = False, recompute: bool = False, pp: int = 1,
                cp: int = 1) -> dict:
    from megatron.core import parallel_state as ps

    kw = {"model_options": {"recompute_granularity": "full", "recompute_method": "uniform",
                            "recompute_num_layers": 1}} if recompute else {}
    model = actor(cfg, hf_config, path, tp, ep, pp, cp, routing_replay=replay, track_routing=True, **kw)
    if perturb:
        perturb_routers(model, perturb)
    batch = batch.select(list(range(len(batch))))  # a copy: the training pass writes fields
    rl.set_masks(batch, cfg)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rows = [i for i in range(len(batch)) if i % dp_size == dp_rank]
    local = batch.select(rows)
    local.old_logprobs = rl.compute_log_probs(model, local, 1.0)
    out = dict(model.routing_metrics)
    diff = ((local.old_logprobs - local.rollout_logprobs).abs() * local.response_mask).max().reshape(1).to(device())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    out["logprob_max_abs_diff"] = float(diff)
    out["tokens"] = int(batch.response_mask.sum())
    if own_check:
        s = torch.tensor(used_routing_fraction(model, local), dtype=torch.float64, device=device())
        dist.all_reduce(s)
        out["own_used_equal_engine"] = float(s[0] / s[1])
    if train:
        batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0) + 0.2 * batch.response_mask
        batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(4))
        batch.advantages *= batch.response_mask
        m = dp_update(model, cfg, batch, 0)
        out.update(loss=m["actor/pg_loss"], grad_norm=m["actor/grad_norm"])
    return out


def rl_loop(root: Path) -> dict:
    from megarl.tasks.arith import write_task_files
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    def files():
        save_tiny_model(root / "loop_model", TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96,
                                                           family="qwen3_moe", num_experts=4, moe_topk=2,
                                                           moe_intermediate=32, initializer_range=0.2))
        write_task_files(root / "task", n_sft=4, n_train=16, n_eval=4, seed=0)

    on_rank0(files)
    overrides = [
        f"data.train_path={root / 'task' / 'train.jsonl'}", "data.prompt_template=arith",
        "reward.sources={arith: math}", f"model.hf_path={root / 'loop_model'}", "data.max_prompt_len=32",
        "actor.max_tokens_per_microbatch=128", "parallel.ep=2", "parallel.gpus_per_node=4",
        "algorithm.routing_replay=true", *GRPO_STEP,
    ]
    train_run(None, overrides, root / "run", 1)
    return {"rows": metrics_rows(root / "run")}


def main():
    a = parse_args()
    root = a.root
    path = root / "qwen3_moe"
    if not dist.is_initialized():
        init_distributed(ParallelSizes(), seed=3)
    on_rank0(make_tiny_moe, "qwen3_moe", path, seed=0)
    cfg = load_config(None, ["actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.clip_grad=0.05",
                             "actor.max_tokens_per_microbatch=40", "algorithm.entropy_coef=0.01",
                             "data.max_prompt_len=16", "rollout.max_new_tokens=16"])
    hf_config = tiny_moe_config("qwen3_moe")
    res: dict = {"layouts": {}, "replay": {}, "seconds": {"start": time.time() - START}}
    ref = None
    for tp, ep in LAYOUTS:
        out, weights = run_layout(cfg, hf_config, path, tp, ep, ref)
        ref = weights if ref is None else ref
        res["layouts"][f"tp{tp}_ep{ep}"] = out
    res["freeze"] = freeze_router(cfg, hf_config, path)
    res["aux_loss"] = aux_loss(cfg, hf_config, path)
    res["dense_sp"] = dense_sequence_parallel(cfg, root)
    res["seconds"]["layouts_freeze_aux"] = time.time() - START
    r = res["replay"]
    samples = engine_batch(path)
    r["same_weights_tp2_ep2"] = replay_case(cfg, hf_config, path, samples, 2, 2, replay=True, perturb=0.0)
    r["perturbed_tp1_ep2_off"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=False, perturb=0.3,
                                             own_check=True)
    r["perturbed_tp1_ep2_on"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=True, perturb=0.3,
                                            own_check=True, train=True)
    r["perturbed_tp1_ep2_on_recompute"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=True, perturb=0.3,
                                                      train=True, recompute=True)
    # PP2: 1F1B keeps several micro-batches in flight; recompute pops their experts in order
    r["perturbed_pp2_ep2_on_recompute"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=True, perturb=0.3,
                                                      train=True, recompute=True, pp=2)
    # CP2: each rank routes its chunks of every sequence (MicroBatch.cp_shard)
    r["perturbed_cp2_ep2_on"] = replay_case(cfg, hf_config, path, samples, 1, 2, replay=True, perturb=0.3,
                                            train=True, cp=2)
    r["perturbed_tp2_ep2_on"] = replay_case(cfg, hf_config, path, samples, 2, 2, replay=True, perturb=0.3)
    res["seconds"]["replay"] = time.time() - START
    t = time.time()
    res["loop"] = rl_loop(root)
    res["seconds"]["loop"] = time.time() - t
    finish(a.out, res)


if __name__ == "__main__":
    main()
