"""Rollout-engine utilisation: synchronous PPO vs T-PPO windows with successive batching.

    python -m tools.research.sim_rollout                                  # DAPO-like long tail up to 20480 tokens
    python -m tools.research.sim_rollout --metrics RUN_DIR/metrics.jsonl  # lengths of a run (response_length/p*)
    python -m tools.research.sim_rollout --windows 512 1024 2048 --batch 256 --n 4 --median 60 --max-len 200

Model. `batch` slots (prompts x n samples), spread evenly over `engines` rollout engines, generate in
lock-step decode steps; a decode step with b active sequences takes `decode_ms + per_seq_ms *
ceil(b / engines)` milliseconds (memory-bound decoding: a fixed weight read and launch cost plus a
KV-cache read per sequence of the engine). A slot is idle while its sequence has finished and the
step still decodes for others. Each step also pays `step_overhead_s` (weight sync, phase switches)
and, optionally, training at `train_tokens_per_s` over every trained sequence (prompt + response so
far: the trainer recomputes log-probs over whole sequences). Defaults: a TP=8 engine per node for a
32B model, 16 engines; an assumption to vary, not a measurement.

- Synchronous PPO: all `batch` responses start together; the step's generation lasts as long as the
  longest response.
- T-PPO (window W): every active sample generates min(W, tokens left) tokens per step; finished
  samples leave, unfinished ones continue next step (re-prefilling prompt + response so far at
  `prefill_us_per_token`), and free slots take new prompts in groups of n.

Printed per mode: engine idle fraction (the generation bubble: 1 - busy slot-steps / (batch x
decode steps), independent of the time model), finished samples per second (steady state: T-PPO
after its first windows), generated tokens per second of generation time, and generation seconds
per step.

Lengths: a lognormal(median, sigma) clipped to [1, max_len] (the default `--median 3500 --sigma
0.75 --max-len 20480` puts ~1% of the responses at the cap: DAPO's long tail), or the
response-length quantiles (response_length/min, p10..p99, max) averaged over a run's
metrics.jsonl rows, sampled by linear interpolation of the inverse CDF.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.sim_rollout`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tools._options import add_options

QUANTILES = (10, 25, 50, 75, 90, 99)


@dataclass
class Engine:
    decode_ms: float = 10.0
    per_seq_ms: float = 0.035
    engines: int = 16
    prefill_us_per_token: float = 0.5
    step_overhead_s: float = 5.0
    train_tokens_per_s: float | None = None  # None: generation only

    def decode_s(self, active: np.ndarray) -> float:
        """Seconds of the decode steps whose active-sequence counts are `active`."""
        return float((self.decode_ms + self.per_seq_ms * np.ceil(active / self.engines)).sum()) / 1e3

    def train_s(self, tokens: float) -> float:
        return tokens / self.train_tokens_per_s if self.train_tokens_per_s else 0.0


def lognormal_lengths(rng: np.random.Generator, median: float, sigma: float, max_len: int):
    def draw(k: int) -> np.ndarray:
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, k)), 1, max_len).astype(np.int64)
    return draw


def metrics_lengths(rng: np.random.Generator, path: Path, last: int | None):
    """Sampler from the response-length quantiles of a run's metrics rows (averaged)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    keys = ["response_length/min", *(f"response_length/p{q}" for q in QUANTILES), "response_length/max"]
    rows = [r for r in rows if all(r.get(k) is not None for k in keys)]
    if not rows:
        raise SystemExit(f"{path}: no rows with {keys} (runs log them since T-PPO landed)")
    rows = rows[-last:] if last else rows
    values = np.array([[r[k] for k in keys] for r in rows]).mean(0)
    probs = np.array([0.0, *(q / 100 for q in QUANTILES), 1.0])

    def draw(k: int) -> np.ndarray:
        return np.maximum(np.rint(np.interp(rng.random(k), probs, np.maximum.accumulate(values))), 1).astype(np.int64)
    return draw


def _active_counts(budgets: np.ndarray) -> np.ndarray:
    """b_s = #{i: budgets_i >= s} for s = 1..max(budgets) (sequences still decoding at step s)."""
    if budgets.size == 0:
        return np.zeros(0)
    srt = np.sort(budgets)
    steps = np.arange(1, int(srt[-1]) + 1)
    return budgets.size - np.searchsorted(srt, steps, side="left")


def _result(busy: float, slot_steps: float, tokens: float, gen: float, finished: int, wall: float, steps: int) -> dict:
    return {"idle": 1 - busy / slot_steps, "samples_per_s": finished / wall, "tokens_per_s": tokens / gen,
            "gen_s_per_step": gen / steps}


def simulate_sync(draw, batch: int, steps: int, prompt_len: int, eng: Engine) -> dict:
    busy = slot_steps = gen = wall = 0.0
    for _ in range(steps):
        lengths = draw(batch)
        active = _active_counts(lengths)
        g = eng.decode_s(active)
        busy, slot_steps, gen = busy + float(active.sum()), slot_steps + batch * active.size, gen + g
        wall += g + eng.step_overhead_s + eng.train_s(float((lengths + prompt_len).sum()))
    return _result(busy, slot_steps, busy, gen, batch * steps, wall, steps)


def simulate_tppo(draw, batch: int, n: int, window: int, steps: int, warmup: int, prompt_len: int,
                  eng: Engine) -> dict:
    remaining = np.zeros(0, dtype=np.int64)  # tokens each active sample still has to generate
    done = np.zeros(0, dtype=np.int64)  # tokens generated so far
    busy = slot_steps = gen = wall = 0.0
    finished = 0
    for step in range(steps):
        new = ((batch - remaining.size) // n) * n
        remaining = np.concatenate([remaining, draw(new)])
        done = np.concatenate([done, np.zeros(new, dtype=np.int64)])
        budgets = np.minimum(remaining, window)
        active = _active_counts(budgets)
        g = eng.decode_s(active) + float((prompt_len + done[done > 0]).sum()) * eng.prefill_us_per_token / 1e6
        done, remaining = done + budgets, remaining - budgets
        t = g + eng.step_overhead_s + eng.train_s(float((done + prompt_len).sum()))
        keep = remaining > 0
        if step >= warmup:
            busy, slot_steps = busy + float(active.sum()), slot_steps + batch * active.size
            gen, wall, finished = gen + g, wall + t, finished + int((~keep).sum())
        remaining, done = remaining[keep], done[keep]
    return _result(busy, slot_steps, busy, gen, finished, wall, steps - warmup)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: lengths from its response_length/p* rows")
    p.add_argument("--last", type=int, help="with --metrics: only the last N rows")
    add_options(p, median=3500.0, sigma=0.75, max_len=20480)
    p.add_argument("--batch", type=int, default=8192, help="samples generated at once (prompts x n)")
    p.add_argument("--n", type=int, default=16, help="samples per prompt: T-PPO refills slots in groups of n")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=20,
                   help="synchronous steps (T-PPO: enough windows for about as many samples)")
    p.add_argument("--decode-ms", type=float, default=Engine.decode_ms)
    p.add_argument("--per-seq-ms", type=float, default=Engine.per_seq_ms)
    p.add_argument("--engines", type=int, default=Engine.engines)
    p.add_argument("--prefill-us-per-token", type=float, default=Engine.prefill_us_per_token)
    p.add_argument("--step-overhead-s", type=float, default=Engine.step_overhead_s)
    p.add_argument("--train-tokens-per-s", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    if a.metrics:
        draw, source = metrics_lengths(rng, a.metrics, a.last), f"{a.metrics} response_length quantiles"
    else:
        draw = lognormal_lengths(rng, a.median, a.sigma, a.max_len)
        source = f"lognormal median {a.median:g} sigma {a.sigma:g} clipped to [1, {a.max_len}] (DAPO-like long tail)"
    eng = Engine(a.decode_ms, a.per_seq_ms, a.engines, a.prefill_us_per_token, a.step_overhead_s, a.train_tokens_per_s)
    sample = draw(200_000)
    print(f"lengths: {source}: mean {sample.mean():.0f}, p50 {np.percentile(sample, 50):.0f}, "
          f"p99 {np.percentile(sample, 99):.0f}, max {sample.max()}, at max {np.mean(sample == sample.max()):.2%}")
    train = f"{a.train_tokens_per_s:g} tokens/s" if a.train_tokens_per_s else "not counted"
    print(f"batch {a.batch} (groups of {a.n}) on {a.engines} engines; decode step {a.decode_ms:g} ms + "
          f"{a.per_seq_ms:g} ms x active per engine; "
          f"re-prefill {a.prefill_us_per_token:g} us/token; step overhead {a.step_overhead_s:g} s; training {train}")
    print(f"{'mode':<16}{'idle_frac':>10}{'samples/s':>12}{'gen_tok/s':>12}{'gen_s/step':>12}")
    sync = simulate_sync(draw, a.batch, a.steps, a.prompt_len, eng)
    print(f"{'sync PPO':<16}{sync['idle']:>10.3f}{sync['samples_per_s']:>12.2f}{sync['tokens_per_s']:>12.0f}"
          f"{sync['gen_s_per_step']:>12.1f}")
    mean = float(sample.mean())
    for w in a.windows:
        windows_per_sample = max(int(np.ceil(mean / w)), 1)
        warmup = 4 * int(np.ceil(a.max_len / w)) if not a.metrics else 4 * int(np.ceil(sample.max() / w))
        steps = warmup + a.steps * windows_per_sample
        r = simulate_tppo(draw, a.batch, a.n, w, steps, warmup, a.prompt_len, eng)
        print(f"{f'T-PPO W={w}':<16}{r['idle']:>10.3f}{r['samples_per_s']:>12.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['gen_s_per_step']:>12.1f}"
              f"   x{r['samples_per_s'] / sync['samples_per_s']:.2f} samples/s")


if __name__ == "__main__":
    main()
