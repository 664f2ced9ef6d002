"""Train a pairwise generative reward model (Pairwise-RL judge) with megarl's SFT path and export it.

    python -m tools.train_genrm --config configs/quickstart/pairwise_rl.yaml \\
        --train-pairs runs/x/task/judge_train.jsonl --eval-pairs runs/x/task/judge_eval.jsonl \\
        --init runs/x/sft_actor --out runs/x/judge [--nproc 2] [key=value ...]

Pairs are JSONL rows {prompt, chosen, rejected}; each becomes two SFT rows (both orders, labels
swapped) rendered with the config's reward.judge template (megarl.trainer.genrm_train). The judge
starts from `--init` (a megarl model checkpoint, e.g. the SFT policy; default model.load) at the
config's model.hf_path architecture, trains for reward.judge_train.steps, and is exported to
<out>/hf (set reward.judge_path to it). With --eval-pairs, the held-out pairwise accuracy (both
orders) is printed and written to <out>/judge_eval.json. Spawns torchrun (gloo on CPU) with
--nproc ranks unless already running under torchrun.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.train_genrm`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    from megarl.config.cli import add_config_arguments

    p = argparse.ArgumentParser(prog="tools/train_genrm.py", description=__doc__.split("\n\n")[0])
    add_config_arguments(p)
    p.add_argument("--train-pairs", required=True, help="preference pairs (JSONL: prompt, chosen, rejected)")
    p.add_argument("--eval-pairs", default=None, help="held-out pairs for the accuracy report")
    p.add_argument("--init", default=None, help="model checkpoint to start from (default: model.load)")
    p.add_argument("--out", required=True, help="output dir: ckpt/ (torch_dist), hf/ (the judge), judge_eval.json")
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: parallel.tp)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from megarl.log import setup_logging
    from megarl.config.cli import config_from_args
    from megarl.parallel.distributed import destroy_distributed
    from megarl.trainer.genrm_train import train_pairwise_judge

    setup_logging()
    cfg = config_from_args(args)
    if not cfg.model.hf_path:
        raise SystemExit("tools/train_genrm.py: model.hf_path (the judge's architecture and tokenizer) is not set")
    try:
        train_pairwise_judge(cfg, args.train_pairs, args.eval_pairs, args.out, init_load=args.init)
    finally:
        destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run(args)
    from megarl.config.cli import config_from_args
    from megarl.trainer.loggers import LoggerError, check_loggers

    cfg = config_from_args(args)
    try:
        check_loggers(cfg)  # the judge's SFT logs through trainer.loggers: a missing package stops here, not in a rank
    except LoggerError as e:
        raise SystemExit(f"tools/train_genrm.py: {e}") from None
    nproc = args.nproc or cfg.parallel.tp
    if nproc == 1:
        return run(args)
    from megarl.parallel.launch import run_module

    return run_module(nproc, "tools.train_genrm", argv)


if __name__ == "__main__":
    sys.exit(main())
