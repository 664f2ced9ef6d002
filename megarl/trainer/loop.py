"""The RL loop, top to bottom. Colocated SPMD: every rank runs this file under torchrun.

step:  rollout (generate, reward, shape, filter; T-PPO: one window of every active sample; then each
       row's payload moves once, to the DP replica that trains it: megarl/trainer/rows.py) -> prepare (old log-probs, ref log-probs, values, off-policy correction) -> advantages ->
       critic update -> actor update -> weight sync -> log/eval/save
"""

from __future__ import annotations

import math
import time

from megarl.config import MegaRLConfig
from megarl.parallel.distributed import init_distributed
from megarl.trainer import rl
from megarl.trainer.checkpoint import finalize_async_saves
from megarl.trainer.components import build_components
from megarl.trainer.progress import Progress
from megarl.trainer.rows import RowTable
from megarl.trainer.step_collector import step_collector
from megarl.trainer.state import TrainerState


def train(cfg: MegaRLConfig) -> dict:
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    run = build_components(cfg)
    al, tr, timer = cfg.algorithm, cfg.trainer, run.timer
    collect = step_collector(cfg, run)
    kl = rl.kl_controller(cfg)
    state = TrainerState(kl_coef=kl.value)
    if tr.resume:
        run.resume(state)
        kl.value = state.kl_coef

    run.start_engine()
    run.sync_weights(state.step)
    first_eval = run.evaluate(state.step) if (tr.val_before_train and state.step == 0) else {}
    last_eval: dict[str, float] = {}
    progress = Progress("RL", total=tr.total_steps, start=state.step, enabled=run.logger.enabled)
    for step in range(state.step, tr.total_steps):
        t_step = time.perf_counter()
        # ---- rollout: every rank's rows as RowMetas; each payload then moves once, to its trainers ----
        with timer("rollout"):
            with run.generation(release=True):
                rows, metrics = collect(step, state)
            local, here, minibatches = run.take_rows(rows, step, state)  # megarl/trainer/rows.py
        rl.set_masks(local, cfg)

        # ---- prepare -----------------------------------------------------------------------------
        pretraining_critic = rl.value_pretraining(cfg, step, state.value_pretrain_end)
        with timer("prepare"):
            local.old_logprobs = rl.compute_log_probs(run.actor, local, cfg.rollout.temperature)
            metrics.update(run.actor.routing_metrics)  # MoE: engine/trainer routing agreement of this pass
            if run.ref is not None:
                local.ref_logprobs = rl.compute_log_probs(run.ref, local, cfg.rollout.temperature)
            if run.prm is not None:  # code PRM: dense line rewards (megarl.trainer.prm)
                local.prm_rewards = run.prm.dense_rewards(local)
            if run.critic is not None:
                local.values = rl.compute_values(run.critic, local)
            metrics.update(rl.rollout_correction(local, cfg, run.dp_group))
            metrics.update(rl.compute_advantages(RowTable.of(rows), local, here, cfg, run.dp_group, kl.value,
                                                 pretraining_critic))

        # ---- train -------------------------------------------------------------------------------
        for _ in range(al.ppo_epochs):
            if run.critic is not None:
                with timer("critic_update"):
                    metrics["critic/lr"] = run.critic.set_lr(step)
                    metrics.update(rl.update(run.critic, local, minibatches, lambda c: rl.critic_loss_fn(cfg, c),
                                              run.dp_group, local.value_mask))
                metrics.update(rl.explained_variance(local, run.dp_group))
            if not pretraining_critic:
                with timer("actor_update"):
                    metrics["actor/lr"] = run.actor.set_lr(step - policy_start(al, state))
                    metrics.update(rl.update(run.actor, local, minibatches,
                                              lambda c: rl.actor_loss_fn(cfg, c, cfg.rollout.temperature),
                                              run.dp_group, local.loss_mask))
        if pretraining_critic and rl.value_pretraining_converged(cfg, metrics["critic/explained_variance"]):
            state.value_pretrain_end = step + 1
        if run.critic is not None:
            metrics["critic/pretraining"] = float(pretraining_critic)
        _check_finite(metrics, step)
        metrics.update(rl.logprob_mismatch(local, run.dp_group))
        if "actor/reward_kl" in metrics:
            kl.update(metrics["actor/reward_kl"], len(rows))
        state.step, state.kl_coef = step + 1, kl.value
        run.sync_weights(state.step)  # also after critic-only steps: the released engine lost its weights

        # ---- log / eval / checkpoint ----------------------------------------------------------------
        metrics.update(timer.pop())
        metrics["time/step"] = time.perf_counter() - t_step
        metrics["perf/tokens_per_s"] = sum(m.length for m in rows) / metrics["time/step"]
        del local, rows  # this step's batch is gone before the next rollout
        last = state.step == tr.total_steps
        if state.step % tr.log_interval == 0 or last:
            run.logger.log(state.step, metrics)
        if (tr.eval_interval and state.step % tr.eval_interval == 0) or last:
            last_eval = run.evaluate(state.step)
        if (tr.save_interval and state.step % tr.save_interval == 0) or last:
            run.save(state)
        finalize_async_saves(blocking=last)  # trainer.async_save: `latest` moves once the writes finished
        progress.update(state.step, reward=metrics.get("reward/accuracy", 0.0), eval=last_eval.get("eval/accuracy"))
    progress.close()
    run.logger.close()
    return {"first_eval": first_eval, "last_eval": last_eval, "rows": dict(run.row_stats)}


def policy_start(al, state: TrainerState) -> int:
    """The first policy-training step: where value pretraining met its explained-variance target,
    else its step cap. The actor's lr schedule counts from there."""
    return al.value_pretrain_steps if state.value_pretrain_end is None else state.value_pretrain_end


def _check_finite(metrics: dict[str, float], step: int) -> None:
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"step {step}: non-finite metrics {bad}; no checkpoint written for this step")
