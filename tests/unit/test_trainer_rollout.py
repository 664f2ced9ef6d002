"""DAPO dynamic sampling in the trainer: filtering on accuracy, refill rounds, truncation, limits.

The generator here is scripted (each prompt's group has a fixed number of correct samples) so
the expected batches can be written out; the engine itself is tested in test_rollout_*.
"""

import pytest

from megarl.config import load_config
from megarl.trainer.batch import Trajectory
from megarl.trainer.step_collector import collect_step_batch, keep_mixed_groups


class ScriptedWorker:
    """Group of prompt `p` has `correct[p]` correct samples out of n."""

    def __init__(self, correct: dict[str, int]):
        self.correct, self.metrics, self.calls = correct, {}, 0

    def generate(self, items, encoded, sampling):
        self.calls += 1
        out = []
        for uid in items:
            for k in range(sampling.n):
                ok = k < self.correct[uid]
                out.append(Trajectory(uid=uid, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[0.0, 0.0],
                                      finish_reason="stop", score=1.0 if ok else -1.0, acc=ok))
        return out


def make(cfg_overrides, correct):
    cfg = load_config("configs/algorithms/dapo.yaml", ["rollout.n_samples_per_prompt=4", "algorithm.mini_batch_size=4", *cfg_overrides])
    stream = iter(sorted(correct))
    return cfg, (lambda n: [next(stream) for _ in range(n)]), ScriptedWorker(correct)


def test_keep_mixed_groups_filters_on_accuracy_not_reward():
    g = [Trajectory("a", [1], [2], [0.0], "stop", score=0.5, acc=True) for _ in range(2)]  # all correct
    h = [Trajectory("b", [1], [2], [0.0], "stop", score=-1.0 + i, acc=bool(i)) for i in range(2)]
    assert keep_mixed_groups([g, h]) == [h]


def test_refill_rounds_then_truncate():
    # prompts p0..p7; mixed: p1, p2, p5, p6 (0 < correct < 4)
    correct = {f"p{i}": c for i, c in enumerate([0, 1, 3, 4, 0, 2, 2, 4])}
    cfg, next_items, worker = make(["rollout.prompts_per_step=3", "rollout.gen_batch_prompts=4"], correct)
    buffer = []
    batch, m = collect_step_batch(next_items, lambda items: [[0]] * len(items), worker, cfg, 0, buffer)
    assert worker.calls == 2 and m["rollout/rounds"] == 2.0
    assert [t.uid for t in batch][::4] == ["p1", "p2", "p5"] and len(batch) == 12
    assert buffer == []  # surplus group p6 dropped (verl recipe)


def test_carry_over_keeps_surplus_groups():
    correct = {f"p{i}": c for i, c in enumerate([0, 1, 3, 4, 0, 2, 2, 4])}
    cfg, next_items, worker = make(["rollout.prompts_per_step=3", "rollout.gen_batch_prompts=4",
                                    "rollout.carry_over_groups=true"], correct)
    buffer = []
    collect_step_batch(next_items, lambda items: [[0]] * len(items), worker, cfg, 0, buffer)
    assert [g[0].uid for g in buffer] == ["p6"]


def test_too_few_mixed_groups_raise_after_max_rounds():
    correct = {f"p{i}": 4 for i in range(40)}
    cfg, next_items, worker = make(["rollout.prompts_per_step=2", "rollout.gen_batch_prompts=4",
                                    "rollout.max_gen_batches=3"], correct)
    with pytest.raises(RuntimeError, match="3 generation rounds"):
        collect_step_batch(next_items, lambda items: [[0]] * len(items), worker, cfg, 0, [])
    assert worker.calls == 3


class CountingWorker(ScriptedWorker):
    """Reports reward counts per generate call, as the real worker does."""

    def generate(self, items, encoded, sampling):
        out = super().generate(items, encoded, sampling)
        self.metrics = {"reward/count": float(len(out)), "reward/correct": float(sum(t.acc for t in out))}
        return out


def test_reward_metrics_cover_every_generation_round():
    correct = {f"p{i}": c for i, c in enumerate([0, 1, 3, 4, 0, 2, 2, 4])}
    cfg, next_items, _ = make(["rollout.prompts_per_step=3", "rollout.gen_batch_prompts=4"], correct)
    worker = CountingWorker(correct)
    _, m = collect_step_batch(next_items, lambda items: [[0]] * len(items), worker, cfg, 0, [])
    assert m["rollout/rounds"] == 2.0
    assert m["reward/count"] == 2 * 4 * 4  # both rounds' 16 samples, not only the last round's
    assert m["reward/correct"] == sum(correct.values())
