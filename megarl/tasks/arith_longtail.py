"""Long-tail variant of the quickstart task (the T-PPO quickstart): the same addition chain of thought
(megarl.tasks.arith), but operand widths mixed so that a few problems need much longer responses.

Default mix (`DIGIT_MIX`): 3-digit operands for 85% of the problems (a ~50-token chain of thought)
and 8 digits for 15% (~135 tokens, prompt 23): a synchronous step waits for the 8-digit chains
while most samples finished after 50 tokens. Both operands of a problem have the same width. Every
split (SFT, train, eval) follows the mix; files and row fields are those of
`arith.write_task_files`. (A 3/6/10-digit mix left the quickstart's tiny model at 8% greedy accuracy
after SFT and RL did not move it: each extra operand width costs the model digit-position reading.)

The quickstart task `arith_longtail` (`quickstart.task: arith_longtail`, as configs/quickstart/tppo.yaml
sets) writes it into <run_dir>/task; `python -m megarl.tasks.arith_longtail DIR` writes it anywhere.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from megarl.tasks import QUICKSTART_TASKS, QuickstartTask
from megarl.tasks.arith import sample_operand, write_splits

DIGIT_MIX = {3: 0.85, 8: 0.15}


def draw_problems(rng: random.Random, n: int, mix: dict[int, float], taken: set) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs not in `taken` (which they join), widths drawn from `mix`."""
    widths, weights = list(mix), list(mix.values())
    out: list[tuple[int, int]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * (n + 100):
            raise ValueError(f"arith_longtail: cannot draw {n} distinct new problems with mix {mix}")
        d = rng.choices(widths, weights)[0]
        pair = (sample_operand(rng, d), sample_operand(rng, d))
        if pair not in taken:
            taken.add(pair)
            out.append(pair)
    return out


def write_longtail_task_files(out_dir: str | Path, n_sft: int = 12000, n_train: int = 4000, n_eval: int = 200,
                              seed: int = 1, mix: dict[int, float] | None = None) -> dict[str, Path]:
    """``sft.jsonl``, ``train.jsonl``, ``eval.jsonl`` (pairwise-disjoint problems), as arith's."""
    mix = mix or DIGIT_MIX
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    taken: set = set()
    splits = {split: draw_problems(rng, n, mix, taken) for split, n in (("eval", n_eval), ("train", n_train),
                                                                       ("sft", n_sft))}
    return write_splits(out, splits)


QUICKSTART_TASKS.register("arith_longtail")(QuickstartTask(
    write_files=lambda out_dir, cfg: write_longtail_task_files(out_dir, seed=cfg.trainer.seed)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m megarl.tasks.arith_longtail", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the task directory, e.g. runs/qs_tppo/task")
    p.add_argument("--seed", type=int, default=1, help="problem seed (the quickstart uses trainer.seed, default 1)")
    a = p.parse_args()
    for split, path in write_longtail_task_files(a.out_dir, seed=a.seed).items():
        print(f"{split}: {path}")
