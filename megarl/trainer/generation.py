"""Generation of a step's trajectories: every rank's engine generates and scores its share of the prompts,
and the trajectories are all-gathered so every rank sees the same batch in the same order.

Every rank holds a rollout engine replica (colocated SPMD; SGLang: one engine per rollout_tp ranks).
`RolloutWorker.generate` serves one generation round, `generate_window` one T-PPO window
(megarl/trainer/windows.py); which rounds a step runs is `megarl.trainer.step_collector`'s business.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl.algorithms import overlong_penalty
from megarl.data.sampler import shard_for_rank
from megarl.rollout import Sample, SamplingParams
from megarl.trainer import pag, tools
from megarl.trainer.batch import Trajectory

log = logging.getLogger(__name__)


def sampling_from_config(rollout, *, seed: int) -> SamplingParams:
    return SamplingParams(
        n=rollout.n_samples_per_prompt, temperature=rollout.temperature, top_p=rollout.top_p,
        top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, seed=seed, fire=rollout.fire,
        fire_temperature=rollout.fire_temperature, fire_top_k=rollout.fire_top_k, window=rollout.window_tokens,
    )


PEAK_METRICS = ("rollout/kv_cache_gb",)  # worker metrics that are maxima, not counts or sums


def all_gather_list(local: list) -> list:
    """Concatenates every rank's list in rank order (same result on all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(local)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return [x for p in parts for x in p]


class RolloutWorker:
    """Generates and scores trajectories for prompt items; one per rank."""

    def __init__(self, engine, tokenizer, reward_manager, cfg: MegaRLConfig, ranks_per_engine: int = 1, images=None):
        self.engine = engine
        self.images = images  # megarl.data.images.ImageInputs of a vision-language model, else None
        self.tokenizer = tokenizer
        self.rewards = reward_manager
        self.cfg = cfg
        self.ranks_per_engine = ranks_per_engine  # consecutive ranks sharing one engine (SGLang rollout_tp)
        self.metrics: dict[str, float] = {}  # reward counts and sums of the last generate call
        self.policy_version = 0  # the step whose weights the engine holds (set by the loop)

    def generate(self, items, encoded: list[list[int]], sampling: SamplingParams) -> list[Trajectory]:
        """Generates `sampling.n` responses per item on this engine's share, scores them, gathers.

        Prompts are split across engines (one per rank for the builtin engine, one per
        `rollout_tp` ranks for SGLang, whose group ranks all get the owner's samples back); the
        engine's first rank scores and contributes its trajectories.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        per_engine = self.ranks_per_engine
        replica, n_replicas = rank // per_engine, world // per_engine
        local_items = shard_for_rank(items, replica, n_replicas)
        local_prompts = shard_for_rank(encoded, replica, n_replicas)
        trajs: list[Trajectory] = []
        reward_metrics: dict[str, float] = {}
        multi_turn = self.cfg.algorithm.pag.enable  # PAG: solution, verification, revision (megarl/trainer/pag.py)
        with_tools = self.cfg.rollout.tools.enable  # tool-calling turns (megarl/trainer/tools.py)
        if local_items:
            seed = (sampling.seed or 0) * 1009 + replica
            local_sampling = SamplingParams(**{**sampling.__dict__, "seed": seed})
            images = self.prompt_images(local_items)
            if (multi_turn or with_tools) and images:
                raise ValueError("multi-turn (PAG, tool-calling) rollouts do not take images yet")
            if with_tools:
                samples = tools.generate_turns(self, local_prompts, local_sampling)
            else:
                samples = (pag.generate_turns(self, local_prompts, local_sampling) if multi_turn
                           else self.engine.generate(local_prompts, local_sampling, **images))
            if rank % per_engine == 0:
                score = tools.score if with_tools else pag.score if multi_turn else RolloutWorker._score
                trajs, reward_metrics = score(self, local_items, samples)
        gathered = all_gather_list(trajs)
        self.metrics = _sum_over_ranks(reward_metrics)
        if multi_turn:
            self.metrics.update(pag.rollout_metrics(gathered))
        if with_tools:
            self.metrics.update(tools.rollout_metrics(gathered))
        if hasattr(self.engine, "kv_cache_bytes"):  # builtin engine: the largest KV cache of this call on any rank
            kv = self.engine.kv_cache_bytes if local_items else 0
            self.metrics["rollout/kv_cache_gb"] = max(all_gather_list([kv])) / 2**30
        return gathered

    def generate_window(self, items, encoded: list[list[int]], carried: list[tuple[Any, Trajectory]],
                        sampling: SamplingParams) -> list[Trajectory]:
        """T-PPO: one window (at most `sampling.window` new tokens) for every active sample.

        items / encoded: new prompts, `sampling.n` responses each; carried: (prompt item,
        unfinished trajectory) pairs, continued under the current weights (an empty response
        starts over). Each engine takes its share of both and runs them as one `continue_samples`
        call (a new response continues an empty one), so they decode in one batch. Finished
        samples are scored, unfinished ones ("truncated") score 0 until they finish. Gathered as
        in `generate` (a process without torch.distributed is one engine).
        """
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        replica, n_replicas = rank // self.ranks_per_engine, world // self.ranks_per_engine
        pixels = self.prompt_images(items).get("images") or [None] * len(items)
        fresh = [(item, Trajectory(item.uid, list(ids), [], [], "truncated", **trajectory_images(im)), True)
                 for item, ids, im in zip(items, encoded, pixels) for _ in range(sampling.n)]
        work = shard_for_rank([(item, t, False) for item, t in carried] + fresh, replica, n_replicas)
        active: list[tuple[Any, Trajectory | None, Sample]] = []  # (item, carried trajectory or None, sample)
        if work:
            cont = SamplingParams(**{**sampling.__dict__, "n": 1, "seed": (sampling.seed or 0) * 1009 + replica})
            samples = self.engine.continue_samples([_as_sample(t, i) for i, (_, t, _) in enumerate(work)], cont)
            active = [(item, None if new else t, s) for (item, t, new), s in zip(work, samples)]
        trajs: list[Trajectory] = []
        reward_metrics: dict[str, float] = {}
        if active and rank % self.ranks_per_engine == 0:
            trajs, reward_metrics = self._score_window(active)
        gathered = all_gather_list(trajs)
        self.metrics = _sum_over_ranks(reward_metrics)
        if hasattr(self.engine, "kv_cache_bytes"):  # builtin engine: the largest KV cache of this call on any rank
            kv = self.engine.kv_cache_bytes if work else 0
            self.metrics["rollout/kv_cache_gb"] = max(all_gather_list([kv])) / 2**30
        return gathered

    def prompt_images(self, items) -> dict:
        """`images=` for the engine (pixels of each item's images, None for a text item), or {} when
        no item has images."""
        if self.images is None or not any(getattr(it, "images", None) for it in items):
            return {}
        return {"images": [self.images.pixels(it.images) if it.images else None for it in items]}

    def _score(self, items, samples) -> tuple[list[Trajectory], dict[str, float]]:
        per_sample = [items[s.index] for s in samples]
        scores, accs, metrics = self._rewards(per_sample, samples)
        trajs = [Trajectory(uid=item.uid, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                            rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, score=score, acc=acc,
                            data_source=item.data_source, policy_version=self.policy_version,
                            routed_experts=s.routed_experts, **trajectory_images(s.images))
                 for item, s, score, acc in zip(per_sample, samples, scores, accs)]
        return trajs, metrics

    def _score_window(self, active) -> tuple[list[Trajectory], dict[str, float]]:
        done = [k for k, (_, _, s) in enumerate(active) if s.finish_reason != "truncated"]
        scores, accs, metrics = self._rewards([active[k][0] for k in done], [active[k][2] for k in done])
        result = dict(zip(done, zip(scores, accs)))
        trajs = []
        for k, (item, prior, s) in enumerate(active):
            score, acc = result.get(k, (0.0, False))
            trajs.append(Trajectory(
                uid=item.uid, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, score=score, acc=acc,
                data_source=item.data_source, policy_version=self.policy_version,
                window_start=len(prior.response_ids) if prior is not None else 0,
                start_version=prior.first_version if prior is not None else self.policy_version,
                routed_experts=s.routed_experts, **trajectory_images(s.images),
            ))
        return trajs, metrics

    def _rewards(self, items, samples) -> tuple[list[float], list[bool], dict[str, float]]:
        """Shaped scores (R + overlong punishment) and correctness of samples[i] for items[i]."""
        from megarl.rewards import RewardInput

        if not samples:
            return [], [], {}
        inputs = []
        for item, s in zip(items, samples):
            text = s.text or self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            inputs.append(RewardInput(data_source=item.data_source, prompt=item.prompt, response=text,
                                      gold=item.answer, reference=item.reference, extra=item.extra))
        outputs, metrics = self.rewards.score(inputs)
        algo = self.cfg.algorithm
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        shaping = (overlong_penalty(lengths, overlong_max_len(self.cfg), algo.overlong_cache_len, algo.overlong_factor)
                   if algo.overlong_penalty else torch.zeros(len(samples)))
        return ([float(out.score) + extra for out, extra in zip(outputs, shaping.tolist())],
                [bool(out.acc) for out in outputs], {k: float(v) for k, v in metrics.items()})


def trajectory_images(images) -> dict:
    """A Sample's PromptImages as Trajectory fields."""
    if images is None:
        return {}
    return {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw,
            "videos": images.video_fields() or None}


def _as_sample(t: Trajectory, index: int) -> Sample:
    from megarl.trainer.vision_batch import images_of

    images = images_of(t)
    return Sample(prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), logprobs=list(t.rollout_logprobs),
                  finish_reason="truncated", index=index, images=images)


def overlong_max_len(cfg: MegaRLConfig) -> int:
    """L_max of the soft overlong punishment: algorithm.overlong_max_len, or the generation cap."""
    return cfg.algorithm.overlong_max_len or cfg.rollout.max_new_tokens


def _sum_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    parts = all_gather_list([metrics])
    keys = sorted({k for p in parts for k in p})
    return {k: sum(p.get(k, 0.0) for p in parts) for k in keys}  # reward metrics are counts and sums


def step_seed(cfg: MegaRLConfig, step: int, rnd: int) -> int:
    return cfg.trainer.seed * 1_000_003 + step * 101 + rnd


LENGTH_QUANTILES = (10, 25, 50, 75, 90, 99)  # response_length/p<q> (tools/research/sim_rollout.py reads them)


def generation_metrics(generated: list[Trajectory], batch: list[Trajectory]) -> dict[str, float]:
    """Reward / accuracy over everything generated this step; lengths over the training batch."""
    n = max(len(generated), 1)
    lengths = [len(t.response_ids) for t in batch] or [0]
    q = torch.quantile(torch.tensor(lengths, dtype=torch.float64), torch.tensor([p / 100 for p in LENGTH_QUANTILES],
                                                                                 dtype=torch.float64)).tolist()
    extra = {}
    if batch and all(t.baseline_score is not None for t in batch):  # ReMax
        extra["reward/greedy_baseline_mean"] = sum(t.baseline_score for t in batch) / len(batch)
    return {
        **extra,
        "reward/mean": sum(t.score for t in generated) / n,
        "reward/accuracy": sum(t.acc for t in generated) / n,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        **{f"response_length/p{p}": v for p, v in zip(LENGTH_QUANTILES, q)},
        "response_length/clip_ratio": sum(t.finish_reason == "length" for t in batch) / max(len(batch), 1),
    }
