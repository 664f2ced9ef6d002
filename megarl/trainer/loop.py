"""The RL loop, top to bottom. Colocated SPMD: every rank runs this file under torchrun.

step:  sync weights -> rollout (generate, reward, shape, filter) -> prepare (old log-probs,
       ref log-probs, values) -> advantages -> critic update -> actor update -> log/eval/save
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from megarl.parallel.distributed import init_distributed
from megarl.rollout import SamplingParams
from megarl.trainer import build, checkpoint, ppo
from megarl.trainer.batch import Trajectory
from megarl.trainer.metrics import MetricsLogger, PhaseTimer
from megarl.trainer.progress import Progress
from megarl.trainer.rollout import RolloutWorker, collect_step_batch

log = logging.getLogger(__name__)


def train(cfg) -> dict:
    from megatron.core import parallel_state as ps

    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    rank0 = dist.get_rank() == 0
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    al, ro = cfg.algorithm, cfg.rollout

    actor = build.build_actor(cfg, hf_config)
    critic = build.build_critic(cfg, hf_config, actor) if cfg.critic.enable else None
    ref = build.build_actor(cfg, hf_config, optim=False) if al.kl_coef > 0 else None
    engine = build.build_engine(cfg, hf_config, tokenizer)
    worker = RolloutWorker(engine, tokenizer, build.build_rewards(cfg), cfg,
                           ranks_per_engine=cfg.parallel.rollout_tp if ro.engine == "sglang" else 1)
    data = build.build_data(cfg, tokenizer)
    dp_group, dp_rank, dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    logger, timer = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.tensorboard), PhaseTimer()

    # ---- resume --------------------------------------------------------------------------------
    start_step, ds_buffer = 0, []
    latest = checkpoint.read_latest(cfg.trainer.run_dir) if cfg.trainer.resume else None
    if latest is not None:
        actor.load(str(latest / "actor"))
        if critic is not None:
            critic.load(str(latest / "critic"))
        state = checkpoint.load_trainer_state(latest)
        start_step = state["step"]
        data.train.load_state_dict(state["data"])
        ds_buffer = [[Trajectory(**t) for t in g] for g in state["ds_buffer"]]
        _set_rng(state["rng"])
        if rank0:
            log.info("resumed from %s at step %d", latest, start_step)

    train_models = [m for m in (actor, critic, ref) if m is not None]

    @contextlib.contextmanager
    def engine_has_gpu():
        """Generation phase: actor/critic/ref state leaves the GPU (rollout.offload_train_state; GPU only)."""
        if ro.offload_train_state:
            for m in train_models:
                m.offload()
        engine.resume_memory()
        try:
            yield
        finally:
            for m in train_models:
                m.onload()

    def sync_weights():
        from megarl.weights import stream_hf_weights

        with timer("weight_sync"):
            engine.resume_memory()
            engine.update_weights(stream_hf_weights(actor.modules, hf_config, ro.weight_bucket_mb << 20))

    def evaluate(step: int) -> dict[str, float]:
        """avg@k accuracy (pass@1 averaged over k samples) per eval set and over all sets."""
        out = {}
        with engine_has_gpu():  # one offload for all eval sets
            for ev in data.evals:
                s = {"n_samples": cfg.eval.n_samples, "temperature": cfg.eval.temperature,
                     "top_p": cfg.eval.top_p, "max_new_tokens": cfg.eval.max_new_tokens, **ev.sampling}
                sampling = SamplingParams(n=s["n_samples"], temperature=s["temperature"], top_p=s["top_p"],
                                          max_new_tokens=s["max_new_tokens"], seed=cfg.trainer.seed + step)
                trajs = worker.generate(ev.items, data.encode(ev.items), sampling)
                out[f"eval/{ev.name}/accuracy"] = sum(t.acc for t in trajs) / max(len(trajs), 1)
                out[f"eval/{ev.name}/response_length"] = sum(len(t.response_ids) for t in trajs) / max(len(trajs), 1)
        if out:
            out["eval/accuracy"] = sum(v for k, v in out.items() if k.endswith("/accuracy")) / len(data.evals)
            logger.log(step, out)
        return out

    def next_items(n: int):
        data.train.batch_prompts = n
        return data.train.next_batch()

    sync_weights()
    first_eval = evaluate(start_step) if (cfg.trainer.val_before_train and start_step == 0) else {}
    last_eval: dict[str, float] = {}
    progress = Progress("RL", total=cfg.trainer.total_steps, start=start_step, enabled=rank0)
    for step in range(start_step, cfg.trainer.total_steps):
        t_step = time.perf_counter()
        # ---- rollout -----------------------------------------------------------------------------
        with timer("rollout"), engine_has_gpu():
            batch, metrics = collect_step_batch(next_items, data.encode, worker, cfg, step, ds_buffer)
            engine.release_memory()  # colocated: the engine's memory goes back to training
        ppo.set_masks(batch, cfg)
        minibatches = ppo.split_minibatches(batch, al.mini_batch_size, cfg.trainer.seed + step, dp_rank, dp_size)
        local = [t for mb in minibatches for t in mb]

        # ---- prepare -----------------------------------------------------------------------------
        with timer("prepare"):
            ppo.compute_log_probs(actor, local, "old_logprobs", ro.temperature)
            if ref is not None:
                ppo.compute_log_probs(ref, local, "ref_logprobs", ro.temperature)
            if critic is not None:
                ppo.compute_values(critic, local)
            pretraining_critic = step < al.value_pretrain_steps
            ppo.compute_advantages(batch, local, cfg, dp_group, critic_only_returns=pretraining_critic)

        # ---- train -------------------------------------------------------------------------------
        for _ in range(al.ppo_epochs):
            if critic is not None:
                with timer("critic_update"):
                    metrics["critic/lr"] = critic.set_lr(step)
                    metrics.update(ppo.update(critic, minibatches, lambda c: ppo.critic_loss_fn(cfg, c),
                                              dp_group, "value_mask"))
                metrics.update(_explained_variance(local, dp_group))
            if not pretraining_critic:
                with timer("actor_update"):
                    metrics["actor/lr"] = actor.set_lr(step - al.value_pretrain_steps)
                    metrics.update(ppo.update(actor, minibatches, lambda c: ppo.actor_loss_fn(cfg, c, ro.temperature),
                                              dp_group, "loss_mask"))
        _check_finite(metrics, step)
        metrics.update(_mismatch(local, dp_group))
        sync_weights()  # also after critic-only steps: the released engine lost its weights (SGLang)

        # ---- log / eval / checkpoint ----------------------------------------------------------------
        done = step + 1
        metrics.update(timer.pop())
        metrics["time/step"] = time.perf_counter() - t_step
        metrics["perf/tokens_per_s"] = sum(t.length for t in batch) / metrics["time/step"]
        if done % cfg.trainer.log_interval == 0 or done == cfg.trainer.total_steps:
            logger.log(done, metrics)
        if (cfg.trainer.eval_interval and done % cfg.trainer.eval_interval == 0) or done == cfg.trainer.total_steps:
            last_eval = evaluate(done)
        if (cfg.trainer.save_interval and done % cfg.trainer.save_interval == 0) or done == cfg.trainer.total_steps:
            models = {"actor": actor, **({"critic": critic} if critic is not None else {})}
            state = {"step": done, "data": data.train.state_dict(), "rng": _get_rng(),
                     "ds_buffer": [[_traj_state(t) for t in g] for g in ds_buffer]}
            checkpoint.save_checkpoint(cfg.trainer.run_dir, done, models, state, cfg.trainer.keep_last)
        progress.update(done, reward=metrics.get("reward/accuracy", 0.0), eval=last_eval.get("eval/accuracy"))
    progress.close()
    logger.close()
    return {"first_eval": first_eval, "last_eval": last_eval}


def _explained_variance(trajs, dp_group) -> dict[str, float]:
    """EV = 1 - Var(ret - V)/Var(ret) over all value tokens of the batch (DP-reduced moments)."""
    from megarl.algorithms import masked_moments, stats_from_moments
    from megarl.trainer.batch import response_tensor

    if not trajs:
        ret = val = mask = torch.zeros(1, 1)
    else:
        ret, mask = response_tensor(trajs, "returns")
        val, _ = response_tensor(trajs, "values")
    m = torch.stack([masked_moments(ret, mask), masked_moments(ret - val, mask)]).double()
    dist.all_reduce(m, group=dp_group)
    (_, var_r), (_, var_d) = stats_from_moments(m[0]), stats_from_moments(m[1])
    return {"critic/explained_variance": float(1.0 - var_d / var_r) if var_r > 0 else 0.0}


def _mismatch(trajs, dp_group) -> dict[str, float]:
    """Mean |rollout log-prob - trainer log-prob| (diagnostic only, ALGORITHMS §0)."""
    s = torch.zeros(2, dtype=torch.float64)
    for t in trajs:
        d = (torch.tensor(t.rollout_logprobs) - t.tensors["old_logprobs"]).abs()
        s += torch.tensor([float(d.sum()), d.numel()], dtype=torch.float64)
    dist.all_reduce(s, group=dp_group)
    return {"rollout/logprob_mismatch": float(s[0] / max(s[1], 1.0))}


def _check_finite(metrics: dict[str, float], step: int) -> None:
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"step {step}: non-finite metrics {bad}; no checkpoint written for this step")


def _traj_state(t: Trajectory) -> dict:
    """A buffered trajectory as plain values (its computed tensors are recomputed each step)."""
    return {f.name: getattr(t, f.name) for f in dataclasses.fields(Trajectory) if f.name != "tensors"}


def _get_rng() -> dict:
    """Global RNG states as tensors / plain values (loadable with torch.load(weights_only=True))."""
    py = random.getstate()
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": list(py[1]), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_extra": [int(pos), int(has_gauss), float(gauss)], "torch": torch.get_rng_state()}


def _set_rng(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), None))
    pos, has_gauss, gauss = state["numpy_extra"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
