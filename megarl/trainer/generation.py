"""Generation of a step's rows: every engine generates and scores its share of the prompts and keeps
the trajectories in its worker's RowStore; every rank gets the RowMetas of all of them
(megarl/trainer/rows.py says where payloads go from there).

Every rank holds a rollout engine replica (colocated SPMD; SGLang: one engine per rollout_tp ranks,
driven by its owner, the group's first rank: the other ranks of the group only learn whether the
owner's work succeeded). `RolloutWorker.generate` serves one generation round, `generate_window` one
T-PPO window (megarl/trainer/windows.py); which rounds a step runs is `megarl.trainer.step_collector`'s
business.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl.algorithms import overlong_penalty
from megarl.data.sampler import shard_for_rank
from megarl.parallel import exchange
from megarl.rollout import Sample, SamplingParams
from megarl.rollout.sglang.requests import run_on_owner
from megarl.trainer import pag, tools
from megarl.trainer.batch import Trajectory
from megarl.trainer.rows import RowMeta, RowStore, gather_metas

log = logging.getLogger(__name__)


def sampling_from_config(rollout, *, seed: int) -> SamplingParams:
    return SamplingParams(
        n=rollout.n_samples_per_prompt, temperature=rollout.temperature, top_p=rollout.top_p,
        top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, seed=seed, fire=rollout.fire,
        fire_temperature=rollout.fire_temperature, fire_top_k=rollout.fire_top_k, window=rollout.window_tokens,
    )


PEAK_METRICS = ("rollout/kv_cache_gb",)  # worker metrics that are maxima, not counts or sums


def fresh_shares(carried: list[int], n_fresh: int) -> list[int]:
    """How many new T-PPO samples each engine takes when engine r continues carried[r] samples:
    every engine's total is as equal as it can be (W // R, the first W % R engines one more, W the
    total), an engine above its quota takes none, and the last engines give back what that
    over-assigns. Without carried samples these are `shard_for_rank`'s sizes."""
    R, W = len(carried), sum(carried) + n_fresh
    share = [max(0, W // R + (r < W % R) - c) for r, c in enumerate(carried)]
    excess = sum(share) - n_fresh
    for r in reversed(range(R)):
        take = min(excess, share[r])
        share[r] -= take
        excess -= take
    return share


class RolloutWorker:
    """Generates and scores rows for prompt items; one per rank. `store` holds the payloads this
    rank generated until the loop frees them (megarl.trainer.rows)."""

    def __init__(self, engine, tokenizer, reward_manager, cfg: MegaRLConfig, ranks_per_engine: int = 1, images=None,
                 routing_dtype: torch.dtype | None = None):
        self.engine = engine
        self.images = images  # megarl.data.images.ImageInputs of a vision-language model, else None
        self.tokenizer = tokenizer
        self.rewards = reward_manager
        self.cfg = cfg
        self.ranks_per_engine = ranks_per_engine  # consecutive ranks sharing one engine (SGLang rollout_tp)
        self.routing_dtype = routing_dtype  # routed experts are kept in it (uint8 when the experts fit)
        self.metrics: dict[str, float] = {}  # reward counts and sums of the last generate call
        self.policy_version = 0  # the step whose weights the engine holds (set by the loop)
        self.store = RowStore()

    def _layout(self) -> tuple[int, int, int, bool]:
        """(rank, this rank's engine, engines, whether this rank drives its engine)."""
        rank, world = exchange.world()
        per = self.ranks_per_engine
        return rank, rank // per, world // per, rank % per == 0

    def _on_owner(self, fn) -> Any:
        """fn() on the engine's owner; an error there is raised on every rank of the engine group,
        and the other ranks get None (the results stay on the owner)."""
        if self.ranks_per_engine == 1:
            return fn()
        group = getattr(self.engine, "group", None)
        if group is None or dist.get_world_size(group) != self.ranks_per_engine:
            raise ValueError(f"an engine shared by {self.ranks_per_engine} ranks needs the process group of those "
                             "ranks as its `group` (megarl.trainer.build.engine_group)")
        return run_on_owner(fn, group, share_result=False)

    def _keep(self, trajs: list[Trajectory]) -> list[Trajectory]:
        if self.routing_dtype is None:
            return trajs
        return [dataclasses.replace(t, routed_experts=t.routed_experts.to(self.routing_dtype))
                if t.routed_experts is not None else t for t in trajs]

    def generate(self, items, encoded: list[list[int]], sampling: SamplingParams,
                 routing: bool = True) -> list[RowMeta]:
        """Generates `sampling.n` responses per item on this engine's share, scores them, keeps them
        in `store` and returns every rank's rows (RowMetas, global order).

        Prompts are split across engines (one per rank for the builtin engine, one per
        `rollout_tp` ranks for SGLang); the engine's owner generates, scores and keeps its
        trajectories. routing=False: no routed experts are recorded (evaluation).
        """
        rank, replica, n_replicas, owner = self._layout()
        local_items = shard_for_rank(items, replica, n_replicas)
        local_prompts = shard_for_rank(encoded, replica, n_replicas)
        multi_turn = self.cfg.algorithm.pag.enable  # PAG: solution, verification, revision (megarl/trainer/pag.py)
        with_tools = self.cfg.rollout.tools.enable  # tool-calling turns (megarl/trainer/tools.py)

        def work():
            if not local_items:
                return [], {}
            seed = (sampling.seed or 0) * 1009 + replica
            local_sampling = SamplingParams(**{**sampling.__dict__, "seed": seed, "return_routing": routing})
            images = self.prompt_images(local_items)
            if (multi_turn or with_tools) and images:
                raise ValueError("multi-turn (PAG, tool-calling) rollouts do not take images yet")
            if with_tools:
                samples = tools.generate_turns(self, local_prompts, local_sampling)
            else:
                samples = (pag.generate_turns(self, local_prompts, local_sampling) if multi_turn
                           else self.engine.generate(local_prompts, local_sampling, **images))
            score = tools.score if with_tools else pag.score if multi_turn else RolloutWorker._score
            return score(self, local_items, samples)

        trajs, reward_metrics = self._on_owner(work) or ([], {})
        rows = gather_metas(self.store, self._keep(trajs), rank)
        self.metrics = _sum_over_ranks(reward_metrics)
        if multi_turn:
            self.metrics.update(pag.rollout_metrics(rows))
        if with_tools:
            self.metrics.update(tools.rollout_metrics(rows))
        self._kv_metric(bool(local_items))
        return rows

    def generate_window(self, items, encoded: list[list[int]], carried: list[tuple[Any, RowMeta]],
                        sampling: SamplingParams) -> list[RowMeta]:
        """T-PPO: one window (at most `sampling.window` new tokens) for every active sample.

        items / encoded: new prompts, `sampling.n` responses each; carried: (prompt item,
        unfinished row) pairs, continued under the current weights (an empty response starts
        over) by the engine that holds them. The new samples fill the engines up to equal loads
        (`fresh_shares`); each engine runs its carried and new samples as one `continue_samples`
        call (a new response continues an empty one), so they decode in one batch. Finished
        samples are scored, unfinished ones ("truncated") score 0 until they finish. Returns
        every rank's rows as `generate` does; a carried row's old payload is superseded by its
        continuation (the loop frees it).
        """
        rank, replica, n_replicas, owner = self._layout()
        per = self.ranks_per_engine
        loads = [0] * n_replicas
        for _, m in carried:
            loads[m.source // per] += 1
        pixels = self.prompt_images(items).get("images") or [None] * len(items)
        fresh = [(item, ids, im) for item, ids, im in zip(items, encoded, pixels) for _ in range(sampling.n)]
        shares = fresh_shares(loads, len(fresh))
        start = sum(shares[:replica])
        mine = [(item, self._carried(m), False) for item, m in carried if m.source == rank]
        mine += [(item, Trajectory(item.uid, list(ids), [], [], "truncated", **trajectory_images(im)), True)
                 for item, ids, im in fresh[start: start + shares[replica]]]

        def work():
            if not mine:
                return [], {}
            cont = SamplingParams(**{**sampling.__dict__, "n": 1, "seed": (sampling.seed or 0) * 1009 + replica})
            samples = self.engine.continue_samples([_as_sample(t, i) for i, (_, t, _) in enumerate(mine)], cont)
            return self._score_window([(item, None if new else t, s) for (item, t, new), s in zip(mine, samples)])

        trajs, reward_metrics = self._on_owner(work) or ([], {})
        rows = gather_metas(self.store, self._keep(trajs), rank)
        self.metrics = _sum_over_ranks(reward_metrics)
        self._kv_metric(bool(mine))
        return rows

    def free(self, rows: list[RowMeta]) -> None:
        """Frees the payloads of these rows that this rank holds (rows no one will train)."""
        rank = exchange.world()[0]
        self.store.drop(m.key for m in rows if m.source == rank)

    def _carried(self, m: RowMeta) -> Trajectory:
        """The payload of a carried row; restarted (`windows.restarted`) when the meta was."""
        t = self.store.get(m.key)
        return restarted(t, m.policy_version) if m.response_len < t.response_len else t

    def _kv_metric(self, worked: bool) -> None:
        if hasattr(self.engine, "kv_cache_bytes"):  # builtin engine: the largest KV cache of this call on any rank
            kv = self.engine.kv_cache_bytes if worked else 0
            self.metrics["rollout/kv_cache_gb"] = max(exchange.all_gather_objects(kv)) / 2**30

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


def restarted(t, version: int):
    """The sample (a RowMeta, or its Trajectory) with its response discarded, to be generated again
    from its prompt under `version`. The engine that holds the payload restarts it when it sees the
    meta's shorter response (`RolloutWorker.generate_window`)."""
    common = dict(finish_reason="truncated", score=0.0, acc=False, policy_version=version, window_start=0,
                  start_version=version)
    if isinstance(t, Trajectory):
        return dataclasses.replace(t, response_ids=[], rollout_logprobs=[], routed_experts=None, **common)
    return dataclasses.replace(t, response_len=0, **common)


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
    parts = exchange.all_gather_objects(metrics)
    keys = sorted({k for p in parts for k in p})
    return {k: sum(p.get(k, 0.0) for p in parts) for k in keys}  # reward metrics are counts and sums


def step_seed(cfg: MegaRLConfig, step: int, rnd: int) -> int:
    return cfg.trainer.seed * 1_000_003 + step * 101 + rnd


LENGTH_QUANTILES = (10, 25, 50, 75, 90, 99)  # response_length/p<q> (tools/research/sim_rollout.py reads them)


def generation_metrics(generated: list, batch: list) -> dict[str, float]:
    """Reward / accuracy over everything generated this step; lengths over the training batch
    (RowMetas or Trajectories)."""
    n = max(len(generated), 1)
    lengths = [t.response_len for t in batch] or [0]
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
