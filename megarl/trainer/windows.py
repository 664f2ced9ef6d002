"""T-PPO successive batching (docs/algorithms.md §5): the rollout phase of a step with rollout.window_tokens.

prompts_per_step * n_samples_per_prompt slots are active at once. At step k (policy version k):

1. carried samples (TrainerState.in_flight) whose first window is more than rollout.max_staleness
   versions old are restarted (empty response, same slot, continued under version k) or dropped
   (slot freed), as rollout.stale_action says;
2. free slots // n new prompts join, n samples each (the batch stays full up to a remainder < n);
3. every active sample generates one window, at most window_tokens new tokens, under version k
   (carried ones continue their response: prompt + response so far are prefilled again);
4. finished samples (EOS, or rollout.max_new_tokens in all) are scored and leave; unfinished ones
   become the next step's in_flight (RowMetas; their payloads stay with the engine that generated
   them, which continues them next step, and are checkpointed by that rank, so a resume continues
   them exactly).

The step trains on every active sample: the policy on its current window, the critic on the
finished ones (megarl.algorithms.tppo). Reward and length metrics are over finished samples.
"""

from __future__ import annotations

from megarl.config import MegaRLConfig
from megarl.algorithms.tppo import staleness_histogram
from megarl.trainer.generation import generation_metrics, restarted, sampling_from_config, step_seed  # noqa: F401


def split_stale(in_flight: list, version: int, max_staleness: int | None) -> tuple[list, list]:
    """(samples that may continue under `version`, samples whose first window is more than
    `max_staleness` versions older than it); order kept."""
    if max_staleness is None:
        return list(in_flight), []
    fresh = [t for t in in_flight if version - t.first_version <= max_staleness]
    stale = [t for t in in_flight if version - t.first_version > max_staleness]
    return fresh, stale


def new_prompt_count(active: int, prompts_per_step: int, n: int) -> int:
    """Prompts that fit the free slots: (prompts_per_step * n - active) // n, at least 0."""
    return max(prompts_per_step * n - active, 0) // n


class SuccessiveBatching:
    """`collect(step, state) -> (rows, metrics)` for rollout.window_tokens (see the module docstring)."""

    def __init__(self, cfg: MegaRLConfig, worker, next_items, encode, dataset_items):
        self.cfg, self.worker, self.next_items, self.encode = cfg, worker, next_items, encode
        self.items = {it.uid: it for it in dataset_items}  # carried samples are scored with their prompt item

    def __call__(self, step: int, state) -> tuple[list[Trajectory], dict[str, float]]:
        ro = self.cfg.rollout
        keep, stale = split_stale(state.in_flight, step, ro.max_staleness)
        restarts = [restarted(t, step) for t in stale] if ro.stale_action == "restart" else []
        carried = keep + restarts
        n_new = new_prompt_count(len(carried), ro.prompts_per_step, ro.n_samples_per_prompt)
        new = self.next_items(n_new) if n_new else []
        trajs = self.worker.generate_window(new, self.encode(new), [(self.items[t.uid], t) for t in carried],
                                            sampling_from_config(ro, seed=step_seed(self.cfg, step, 0)))
        state.in_flight = [t for t in trajs if t.finish_reason == "truncated"]
        finished = [t for t in trajs if t.finish_reason != "truncated"]
        metrics = {
            "rollout/active_samples": float(len(trajs)), "rollout/new_samples": float(len(trajs) - len(carried)),
            "rollout/continued_samples": float(len(keep)), "rollout/restarted_samples": float(len(restarts)),
            "rollout/dropped_samples": float(len(stale) - len(restarts)),
            "rollout/finished_samples": float(len(finished)), "rollout/unfinished_samples": float(len(state.in_flight)),
            "rollout/window_tokens_mean": sum(t.response_len - t.window_start for t in trajs) / max(len(trajs), 1),
            **window_staleness_metrics(trajs),
        }
        if finished:
            metrics.update(generation_metrics(finished, finished))
        return trajs, {**metrics, **self.worker.metrics}


def window_staleness_metrics(trajs: list) -> dict[str, float]:
    """Policy updates each sample of the step spans (latest window's version - first window's):
    mean, max and a histogram rollout/staleness/<updates> = number of samples."""
    ages = [t.policy_version - t.first_version for t in trajs]
    out = {f"rollout/staleness/{a}": float(c) for a, c in staleness_histogram(ages).items()}
    if ages:
        out.update({"rollout/staleness_mean": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages))})
    return out
