"""The rollout phase of a step as the loop sees it: `step_collector(cfg, run)` returns
`collect(step, state) -> (rows, metrics)`: the step's rows as RowMetas in one global order, the
same on every rank, whose payloads stay where they were generated (megarl/trainer/rows.py).

One batch per step from `collect_step_batch` (DAPO's dynamic sampling: generation rounds until the
step has prompts_per_step groups with mixed outcomes; ReMax's greedy baseline), from a user's
`rollout.function` (dotted path, same signature), or T-PPO's successive batching
(megarl/trainer/windows.py) with rollout.window_tokens.
"""

from __future__ import annotations

from megarl.config import MegaRLConfig
from megarl.registry import import_object
from megarl.rollout import SamplingParams
from megarl.trainer.generation import PEAK_METRICS, RolloutWorker, generation_metrics, sampling_from_config, step_seed
from megarl.trainer.rows import RowMeta
from megarl.trainer.windows import SuccessiveBatching


def group_by_uid(trajs: list) -> list[list]:
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.uid, []).append(t)
    return list(groups.values())


def keep_mixed_groups(groups: list[list]) -> list[list]:
    """DAPO dynamic sampling: keep groups with 0 < #correct < G (filter on accuracy, not reward)."""
    return [g for g in groups if 0 < sum(t.acc for t in g) < len(g)]


def collect_step_batch(next_items, encode, worker: RolloutWorker, cfg: MegaRLConfig, step: int,
                       buffer: list[list[RowMeta]]) -> tuple[list[RowMeta], dict[str, float]]:
    """Returns the rows of one step (prompts_per_step groups) and rollout metrics. It decides on
    what `worker.generate` returns (RowMetas; anything with uid, acc, score, response_len,
    finish_reason), so a custom rollout.function of this signature does too; the payloads of rows
    it neither returns nor leaves in `buffer` are freed after it returns.

    Without dynamic sampling: one round of prompts_per_step prompts. With it (DAPO Algorithm 1):
    rounds of gen_batch_prompts prompts; mixed groups go into `buffer` until it holds
    prompts_per_step groups; more than max_gen_batches rounds raise. The surplus is dropped, or
    with rollout.carry_over_groups kept in `buffer` (checkpointed) for the next step.
    """
    ro = cfg.rollout
    stats = {"rollout/rounds": 0.0, "rollout/generated_groups": 0.0}
    all_generated: list[Trajectory] = []
    if not cfg.algorithm.dynamic_sampling:
        items = next_items(ro.prompts_per_step)
        trajs = _generate(worker, items, encode(items), cfg, step_seed(cfg, step, 0))
        stats["rollout/rounds"] = 1.0
        return trajs, {**stats, **generation_metrics(trajs, trajs), **worker.metrics}
    reward_metrics: dict[str, float] = {}
    rnd = 0
    while len(buffer) < ro.prompts_per_step:
        if rnd >= ro.max_gen_batches:
            raise RuntimeError(
                f"dynamic sampling: {rnd} generation rounds (rollout.max_gen_batches) gave only "
                f"{len(buffer)}/{ro.prompts_per_step} groups with mixed outcomes; the prompts are too "
                "easy or too hard for the policy — raise rollout.max_gen_batches or change the data"
            )
        items = next_items(ro.gen_batch_prompts or ro.prompts_per_step)
        trajs = _generate(worker, items, encode(items), cfg, step_seed(cfg, step, rnd))
        all_generated.extend(trajs)
        for k, v in worker.metrics.items():  # counts and sums: add up over the rounds; peaks: the largest
            reward_metrics[k] = max(reward_metrics.get(k, 0.0), v) if k in PEAK_METRICS else reward_metrics.get(k, 0.0) + v
        groups = group_by_uid(trajs)
        kept = keep_mixed_groups(groups)
        _free(worker, [t for g in groups if not any(g is k for k in kept) for t in g])  # only kept groups' payloads stay
        buffer.extend(kept)
        stats["rollout/generated_groups"] += len(groups)
        rnd += 1
    stats["rollout/rounds"] = float(rnd)
    taken, buffer[:] = buffer[: ro.prompts_per_step], buffer[ro.prompts_per_step :]
    if not ro.carry_over_groups:
        _free(worker, [t for g in buffer for t in g])
        buffer.clear()  # docs/algorithms.md §2: truncate to exactly prompts_per_step groups
    batch = [t for g in taken for t in g]
    stats["rollout/kept_group_frac"] = len(taken) / max(stats["rollout/generated_groups"], 1.0)
    return batch, {**stats, **generation_metrics(all_generated or batch, batch), **reward_metrics}


def greedy_sampling(sampling: SamplingParams) -> SamplingParams:
    """One greedy response per prompt (temperature 0, no FIRE, no routed experts: it is never
    trained on), otherwise as `sampling`."""
    return SamplingParams(**{**sampling.__dict__, "n": 1, "temperature": 0.0, "fire": False, "return_routing": False})


def _generate(worker, items, encoded, cfg: MegaRLConfig, seed: int) -> list[RowMeta]:
    """`worker.generate` of one round. With algorithm.advantage=remax also one greedy response per
    prompt (ReMax's baseline, arXiv 2310.10505): its score becomes `baseline_score` of that prompt's
    sampled trajectories, and the greedy trajectory itself is dropped (never trained on).
    worker.metrics keeps the sampled call's reward metrics."""
    sampling = sampling_from_config(cfg.rollout, seed=seed)
    trajs = worker.generate(items, encoded, sampling)
    if cfg.algorithm.advantage != "remax":
        return trajs
    sampled_metrics = dict(worker.metrics)
    greedy = worker.generate(items, encoded, greedy_sampling(sampling))
    _free(worker, greedy)
    baseline = {t.uid: float(t.score) for t in greedy}
    worker.metrics = sampled_metrics
    for t in trajs:
        t.baseline_score = baseline[t.uid]
    return trajs


def _free(worker, rows: list) -> None:
    """The payloads of rows no one will train leave the ranks that hold them (RolloutWorker.free)."""
    if hasattr(worker, "free"):
        worker.free(rows)


def collect_function(cfg: MegaRLConfig):
    """rollout.function (user code by dotted path), or `collect_step_batch`."""
    return import_object(cfg.rollout.function, "rollout.function") if cfg.rollout.function else collect_step_batch


def step_collector(cfg: MegaRLConfig, run):
    """The rollout phase of the loop as `collect(step, state) -> (rows, metrics)`: T-PPO
    successive batching with rollout.window_tokens (state.in_flight carries unfinished samples),
    else one batch per step from `collect_function(cfg)` (state.carried_groups: its buffer)."""
    if cfg.rollout.window_tokens:
        collect = SuccessiveBatching(cfg, run.worker, run.next_items, run.data.encode, run.data.train.dataset)
    else:
        inner = collect_function(cfg)
        collect = lambda step, state: inner(run.next_items, run.data.encode, run.worker, cfg, step, state.carried_groups)

    def collect_step(step, state):
        run.data.train.set_step(step)  # data.first_sources: the batch mix depends on the step
        return collect(step, state)
    return collect_step
