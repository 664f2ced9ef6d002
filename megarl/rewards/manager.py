"""Hybrid reward routing: score a batch of samples by data source, concurrently, never crashing.

    outputs, metrics = RewardManager(cfg, resources={"judge": judge}).score(batch)

Each sample is routed by `data_source` (RewardConfig.route) to a reward function from the
registry. Per-sample functions run in a thread pool (`max_workers`); batch functions (GenRM)
get all samples of their route in one call. Every failure — an exception, a RewardTimeout from
the function, a sample past the manager's deadline, an unroutable data source, an invalid
output — scores the route's failure value, is logged, and is counted. The manager's deadline
is the last line of defence: a function past it is abandoned (its thread keeps running, so
functions must enforce their own hard limits, as the math verifier and sandbox do).

Metrics are additive counts and sums (safe to sum over ranks): reward/count, reward/failures,
reward/timeouts, reward/correct, reward/score_sum, the same per route as reward/<route>/...,
and reward/time_s.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from megarl.parallel.distributed import phase
from megarl.rewards.config import RewardConfig
from megarl.rewards.registry import BuiltReward, build_reward
from megarl.rewards.types import RewardInput, RewardOutput, RewardTimeout

logger = logging.getLogger(__name__)
_LOGGED_FAILURES_PER_CALL = 5


def _finite_score(score) -> bool:
    """A real number (not a bool, string or tensor) that is neither NaN nor infinite."""
    return isinstance(score, numbers.Real) and not isinstance(score, bool) and math.isfinite(score)


@dataclass
class _Job:
    key: str
    indices: list[int]
    is_batch: bool
    timeout_s: float
    started: list[float] = field(default_factory=list)  # set by the worker thread


class RewardManager:
    def __init__(self, cfg: RewardConfig | None = None, resources: dict | None = None):
        self.cfg = cfg or RewardConfig()
        resources = dict(resources or {})
        if self.cfg.math_workers is not None and "math_pool" not in resources:
            from megarl.rewards.math_pool import VerifyPool

            resources["math_pool"] = VerifyPool(size=self.cfg.math_workers)
        self._rewards: dict[str, BuiltReward] = {}
        for key, spec in self.cfg.sources.items():
            try:
                self._rewards[key] = build_reward(spec.fn, self.cfg.params_for(key), resources)
            except (ValueError, TypeError) as e:
                raise ValueError(f"reward.sources.{key}: {e}") from None
        self._executor = ThreadPoolExecutor(self.cfg.max_workers, thread_name_prefix="megarl-reward")
        self._hung = 0  # abandoned calls whose threads are still running
        self._lock = threading.Lock()

    def failure_score(self, key: str | None) -> float:
        spec = self.cfg.sources.get(key) if key is not None else None
        if spec is not None and spec.failure_score is not None:
            return spec.failure_score
        if self.cfg.failure_score is not None:
            return self.cfg.failure_score
        return self.cfg.incorrect_score if key is None else self._rewards[key].failure_score

    def score(self, batch: list[RewardInput]) -> tuple[list[RewardOutput], dict[str, float]]:
        with phase("reward"):
            return self._score(batch)

    def _score(self, batch: list[RewardInput]) -> tuple[list[RewardOutput], dict[str, float]]:
        start = time.monotonic()
        if self._hung >= self.cfg.max_workers:  # every thread is stuck in an abandoned call
            logger.error("reward: all %d worker threads are stuck in abandoned calls; starting a "
                         "fresh thread pool (the stuck threads leak)", self.cfg.max_workers)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = ThreadPoolExecutor(self.cfg.max_workers, thread_name_prefix="megarl-reward")
            self._hung = 0
        outputs: list[RewardOutput | None] = [None] * len(batch)
        routes = [self.cfg.route(x.data_source) for x in batch]
        failures: list[tuple[int, str, bool]] = []  # (index, reason, is_timeout)
        jobs: dict[Future, _Job] = {}
        by_route: dict[str, list[int]] = {}
        for i, key in enumerate(routes):
            if key is None:
                failures.append((i, f"no reward route for data_source {batch[i].data_source!r}", False))
            else:
                by_route.setdefault(key, []).append(i)
        for key, indices in by_route.items():
            built, spec = self._rewards[key], self.cfg.sources[key]
            timeout = spec.timeout_s or self.cfg.timeout_s
            if built.batch_fn is not None:
                job = _Job(key, indices, True, timeout)
                items = [batch[i] for i in indices]
                jobs[self._executor.submit(self._call, job, built.batch_fn, items)] = job
            else:
                for i in indices:
                    job = _Job(key, [i], False, timeout)
                    jobs[self._executor.submit(self._call, job, built.sample_fn, batch[i])] = job
        self._collect(jobs, outputs, failures)
        for i, reason, _ in failures:
            outputs[i] = RewardOutput(self.failure_score(routes[i]), False, {"failure": reason})
        metrics = self._metrics(outputs, routes, failures, time.monotonic() - start)
        self._log_failures(batch, routes, failures)
        return outputs, metrics  # type: ignore[return-value]

    @staticmethod
    def _call(job: _Job, fn, arg):
        job.started.append(time.monotonic())
        return fn(arg)

    def _collect(self, jobs: dict[Future, _Job], outputs, failures) -> None:
        """Waits for the jobs. A running job past its deadline is abandoned; jobs still queued
        when even a full pass over the queue would be late (threads stuck in abandoned calls)
        are cancelled. Both count as timeouts."""
        pending = set(jobs)
        longest = max((j.timeout_s for j in jobs.values()), default=0.0)
        waves = -(-len(jobs) // self.cfg.max_workers)
        give_up = time.monotonic() + longest * (waves + 1)
        while pending:
            now = time.monotonic()
            for f in [f for f in pending if not f.done() and (now > give_up or (
                    jobs[f].started and now - jobs[f].started[0] > jobs[f].timeout_s))]:
                pending.discard(f)
                job = jobs[f]
                if not f.cancel():
                    with self._lock:
                        self._hung += 1
                    f.add_done_callback(self._unhang)
                    logger.error("reward %r: abandoned a call running for more than %.1fs; the "
                                 "function lacks its own time limit", job.key, job.timeout_s)
                failures.extend((i, f"manager deadline {job.timeout_s:.1f}s exceeded", True)
                                for i in job.indices)
            deadlines = [jobs[f].started[0] + jobs[f].timeout_s for f in pending if jobs[f].started]
            timeout = min([*deadlines, give_up, now + 0.5]) - now
            done, pending = wait(pending, timeout=max(0.01, timeout), return_when=FIRST_COMPLETED)
            for f in done:
                self._take(f, jobs[f], outputs, failures)

    def _unhang(self, _fut: Future) -> None:
        with self._lock:
            self._hung = max(0, self._hung - 1)

    def _take(self, fut: Future, job: _Job, outputs, failures) -> None:
        exc = fut.exception()
        if exc is not None:
            failures.extend((i, f"{type(exc).__name__}: {exc}", isinstance(exc, RewardTimeout))
                            for i in job.indices)
            return
        results = fut.result() if job.is_batch else [fut.result()]
        if not isinstance(results, list) or len(results) != len(job.indices):
            failures.extend((i, "batch reward returned a wrong number of outputs", False)
                            for i in job.indices)
            return
        for i, res in zip(job.indices, results):
            if isinstance(res, Exception):
                failures.append((i, f"{type(res).__name__}: {res}", isinstance(res, RewardTimeout)))
            elif not isinstance(res, RewardOutput) or not _finite_score(res.score):
                failures.append((i, f"invalid reward output {res!r} (expected a RewardOutput with a finite "
                                    "float score)", False))
            else:
                outputs[i] = res

    @staticmethod
    def _metrics(outputs, routes, failures, elapsed: float) -> dict[str, float]:
        failed = {i: timeout for i, _, timeout in failures}
        m: dict[str, float] = {"reward/time_s": elapsed}
        for prefix_key in (None, *sorted({r for r in routes if r is not None})):
            prefix = "reward" if prefix_key is None else "reward/" + re.sub(r"[^\w.-]", "_", prefix_key)
            idx = [i for i, r in enumerate(routes) if prefix_key is None or r == prefix_key]
            m[f"{prefix}/count"] = float(len(idx))
            m[f"{prefix}/failures"] = float(sum(i in failed for i in idx))
            m[f"{prefix}/timeouts"] = float(sum(failed.get(i, False) for i in idx))
            m[f"{prefix}/correct"] = float(sum(bool(outputs[i].acc) for i in idx))
            m[f"{prefix}/score_sum"] = float(sum(outputs[i].score for i in idx))
        return m

    @staticmethod
    def _log_failures(batch, routes, failures) -> None:
        for i, reason, _ in failures[:_LOGGED_FAILURES_PER_CALL]:
            logger.warning("reward failure: sample %d (data_source=%r, route=%r): %s",
                           i, batch[i].data_source, routes[i], reason)
        if len(failures) > _LOGGED_FAILURES_PER_CALL:
            logger.warning("reward failures: %d in this batch (%d timeouts); first %d logged above",
                           len(failures), sum(t for _, _, t in failures), _LOGGED_FAILURES_PER_CALL)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
