"""tools/research/sim_rollout.py against hand-computed schedules (the simulator's numbers go to the README)."""


import numpy as np
import pytest


from tools.research import sim_rollout as sim  # noqa: E402

ENGINE = sim.Engine(decode_ms=1.0, per_seq_ms=0.0, engines=1, prefill_us_per_token=0.0, step_overhead_s=0.0)


def lengths_1_then_3(k):
    return np.array(([1, 3] * k)[:k])


def test_sync_step_waits_for_the_longest_response():
    # lengths 1 and 3: decode steps with 2, 1, 1 active -> 4 busy of 6 slot-steps; 3 ms per step
    r = sim.simulate_sync(lengths_1_then_3, batch=2, steps=4, prompt_len=5, eng=ENGINE)
    assert r["idle"] == pytest.approx(1 / 3)
    assert r["samples_per_s"] == pytest.approx(2 / 0.003)
    assert r["tokens_per_s"] == pytest.approx(4 / 0.003) and r["gen_s_per_step"] == pytest.approx(0.003)


def test_tppo_windows_carry_and_refill():
    # W = 2, n = 1. Step 0: lengths 1, 3 -> windows of 1 and 2 tokens (active 2, 1); the first
    # finishes, the second carries 1 token left. Step 1: one new sample (length 1) fills the slot:
    # windows of 1 and 1 (active 2); both finish. 5 busy of 6 slot-steps, 3 samples in 3 ms.
    r = sim.simulate_tppo(lengths_1_then_3, batch=2, n=1, window=2, steps=2, warmup=0, prompt_len=5, eng=ENGINE)
    assert r["idle"] == pytest.approx(1 / 6)
    assert r["samples_per_s"] == pytest.approx(3 / 0.003)
    # re-prefilling the carried sample (prompt 5 + 2 tokens) costs 7 tokens at 1000 us each
    slow = sim.Engine(decode_ms=1.0, per_seq_ms=0.0, engines=1, prefill_us_per_token=1000.0, step_overhead_s=0.0)
    r = sim.simulate_tppo(lengths_1_then_3, batch=2, n=1, window=2, steps=2, warmup=0, prompt_len=5, eng=slow)
    assert r["samples_per_s"] == pytest.approx(3 / 0.010)


def test_decode_time_per_engine_and_training_cost():
    eng = sim.Engine(decode_ms=10.0, per_seq_ms=1.0, engines=4, train_tokens_per_s=100.0)
    assert eng.decode_s(np.array([8, 5, 1])) == pytest.approx((12 + 12 + 11) / 1e3)  # ceil(b / 4) per engine
    assert eng.train_s(250) == pytest.approx(2.5)


def test_quantile_sampler_reads_a_runs_metrics(tmp_path):
    keys = ["min", *(f"p{q}" for q in sim.QUANTILES), "max"]
    row = {f"response_length/{k}": v for k, v in zip(keys, [10, 20, 30, 40, 50, 60, 70, 80])}
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}, ' + str(row)[1:].replace("'", '"') + "\n"
                                                    for i in range(3)))
    draw = sim.metrics_lengths(np.random.default_rng(0), tmp_path / "metrics.jsonl", None)
    x = draw(100_000)
    assert x.min() >= 10 and x.max() <= 80
    assert np.median(x) == pytest.approx(40, abs=1)  # p50
    assert np.mean(x <= 60) == pytest.approx(0.90, abs=0.01)  # p90
