"""Generation phase of synchronous PPO vs T-PPO windows, measured on the builtin engine (CPU or GPU).

    python -m tools.bench.windows --hf runs/qs_tppo/sft_actor/hf --task runs/qs_tppo/task/train.jsonl

One process, fixed weights (no training): `prompts x n` slots. Synchronous: one `generate` of whole
responses per step. T-PPO: `megarl.trainer.windows.SuccessiveBatching` (the trainer's own code
path: continue carried samples, refill free slots, score finished ones) with `--window` tokens per
step. The two alternate for `--rounds` rounds (each: one synchronous step, then as many window
steps as finish about the same number of samples), so a load change on a shared machine hits both.
Prints per mode: generation seconds per finished sample and the generation bubble (1 - generated
tokens / (active samples x the longest segment of each step)), plus the response lengths.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.windows`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import statistics
import time
from tools._options import add_options


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF model directory (e.g. a quickstart's sft_actor/hf)")
    p.add_argument("--task", required=True, help="prompt rows (.jsonl with problem, answer, data_source)")
    add_options(p, template="arith", prompts=64, n=4, max_new=160, window=56, rounds=3, threads=1)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
    from megarl.data.sampler import PromptSampler
    from megarl.rewards import RewardConfig, RewardManager
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.trainer.generation import RolloutWorker, sampling_from_config
    from megarl.trainer.state import TrainerState
    from megarl.trainer.windows import SuccessiveBatching

    torch.set_num_threads(a.threads)
    if not dist.is_initialized():  # RolloutWorker.generate gathers over ranks: a world of one
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    engine = BuiltinEngine.from_pretrained(a.hf)
    items = tokenize_dataset(load_prompt_dataset(a.task), engine.tokenizer, template=a.template,
                             max_prompt_len=64).items
    common = [f"rollout.n_samples_per_prompt={a.n}", f"rollout.prompts_per_step={a.prompts}",
              f"rollout.max_new_tokens={a.max_new}", f"algorithm.mini_batch_size={a.n}"]
    cfg = load_config("configs/algorithms/tppo.yaml", [*common, f"rollout.window_tokens={a.window}"])
    sync_cfg = load_config("configs/algorithms/ppo.yaml", common)
    rewards = RewardManager(RewardConfig.from_dict({"sources": {"arith": "math"}}))
    worker = RolloutWorker(engine, engine.tokenizer, rewards, cfg)
    sync_sampler, win_sampler = PromptSampler(items, a.prompts, seed=0), PromptSampler(items, a.prompts, seed=1)

    def next_items(n):
        win_sampler.batch_prompts = n
        return win_sampler.next_batch()

    windows = SuccessiveBatching(cfg, worker, next_items, lambda its: [list(i.prompt_ids) for i in its], items)
    state, step = TrainerState(), 0
    for _ in range(3 * -(-a.max_new // a.window)):  # warm up to a steady mix of carried and new samples
        windows(step, state)
        step += 1
    stats = {"sync": [], "tppo": []}
    for r in range(a.rounds):
        batch = sync_sampler.next_batch()
        t0 = time.perf_counter()
        trajs = worker.generate(batch, [list(i.prompt_ids) for i in batch],
                                sampling_from_config(sync_cfg.rollout, seed=r))
        dt = time.perf_counter() - t0
        lengths = [len(t.response_ids) for t in trajs]
        stats["sync"].append((dt, len(trajs), sum(lengths), len(trajs) * max(lengths), lengths))
        finished, t_total, tokens, capacity, done_lengths = 0, 0.0, 0, 0, []
        while finished < len(trajs):
            t0 = time.perf_counter()
            out, _ = windows(step, state)
            t_total += time.perf_counter() - t0
            step += 1
            seg = [len(t.response_ids) - t.window_start for t in out]
            tokens, capacity = tokens + sum(seg), capacity + len(out) * max(seg)
            ended = [t for t in out if t.finish_reason != "truncated"]
            finished += len(ended)
            done_lengths += [len(t.response_ids) for t in ended]
        stats["tppo"].append((t_total, finished, tokens, capacity, done_lengths))
        print(f"round {r}: sync {dt:.2f} s for {len(trajs)} samples; T-PPO {t_total:.2f} s for {finished} samples",
              flush=True)
    for mode, rows in stats.items():
        per_sample = [dt / n for dt, n, *_ in rows]
        bubble = 1 - sum(r[2] for r in rows) / sum(r[3] for r in rows)
        lengths = [x for r in rows for x in r[4]]
        print(f"{mode:>5}: {statistics.mean(per_sample) * 1e3:.1f} ms per finished sample "
              f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in per_sample)}); bubble {bubble:.3f}; "
              f"response length mean {statistics.mean(lengths):.1f}, max {max(lengths)}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
