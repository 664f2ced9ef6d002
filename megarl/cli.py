"""`megarl` entry points.

    megarl train --config configs/recipes/... [key=value ...]   (run under torchrun)
    megarl sft --config ... [key=value ...]                      (run under torchrun)
    megarl quickstart [--nproc 2] [key=value ...]                (spawns its own torchrun)
    megarl config [--config ...] [--explain FIELD]
    megarl convert hf-to-megatron | megatron-to-hf | verify ...  (HF <-> torch_dist checkpoints)
    megarl plan --recipe R --layout L [--gpu h100|h200] ...      (per-GPU memory and step time)
    megarl eval --hf DIR | --ckpt DIR --data SET [...]           (avg@n / pass@k / maj@n on eval sets)
    megarl report RUN_DIR                                        (the run's curves: PNG + HTML)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megarl.log import setup_logging
from megarl.registry import import_object

SUBCOMMANDS = {  # command -> its main(argv) -> exit code
    "config": "megarl.config.cli:main",
    "quickstart": "megarl.quickstart:launch",
    "convert": "megarl.convert.cli:main",
    "plan": "megarl.planner.cli:main",
    "eval": "megarl.evaluate.cli:main",
    "report": "megarl.report:main",
}


def _load(args):
    """The config; on rank 0 (the one that logs) its loggers checked (package, network) before any
    work, and the config saved to the run dir."""
    from megarl.config import save_config
    from megarl.config.cli import config_from_args
    from megarl.trainer.loggers import check_loggers

    cfg = config_from_args(args)
    if int(os.environ.get("RANK", "0")) == 0:
        check_loggers(cfg)
        Path(cfg.trainer.run_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, str(Path(cfg.trainer.run_dir) / "config.yaml"))
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in SUBCOMMANDS:  # imported only when asked for (each pulls in its own dependencies)
        return import_object(SUBCOMMANDS[cmd], "megarl command")(rest)
    if cmd not in ("train", "sft"):
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    from megarl.config import ConfigError
    from megarl.config.cli import add_config_arguments
    from megarl.trainer.loggers import LoggerError

    parser = argparse.ArgumentParser(prog=f"megarl {cmd}")
    add_config_arguments(parser)
    args = parser.parse_args(rest)
    setup_logging()
    try:
        cfg = _load(args)
    except (ConfigError, LoggerError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cmd == "train":
        from megarl.trainer.loop import train

        train(cfg)
    else:
        from megarl.trainer.sft import sft

        sft(cfg)
    from megarl.parallel.distributed import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
