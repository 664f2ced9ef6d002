#!/usr/bin/env python
"""Run megarl training on this machine (one node) under torchrun.

    python launch/local.py --recipe configs/recipes/qwen2.5-7b/dapo.yaml \
        --layout configs/layouts/qwen2.5-7b/1node.yaml [--nproc 8] [--dryrun] [key=value ...]

Runs ``torchrun --standalone --nnodes 1 --nproc-per-node N -m megarl.cli train --config RECIPE
[--config LAYOUT] overrides`` from the repository root with the launcher's environment defaults
(CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_CUMEM_ENABLE=0, ...; see launch_common.DEFAULT_ENV). N
defaults to parallel.gpus_per_node of the config; on a CPU machine pass e.g. ``--nproc 2``.
``--dryrun`` prints the command and environment only. The config is validated for this world
and the loggers of ``trainer.loggers`` are checked (package installed, server reachable) before
torchrun starts: an error is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_common import REPO, TRAIN_MODULE, ConfigError, add_common_arguments, check_config  # noqa: E402
from launch_common import fail, compose, from_dict, parse_env, train_args  # noqa: E402
from megarl.trainer.loggers import LoggerError, check_loggers  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap)
    ap.add_argument("--nproc", type=int, help="processes (GPUs) on this node (default: parallel.gpus_per_node)")
    ap.add_argument("--torchrun", default=None, help="torchrun executable (default: the one next to this Python)")
    return ap


def torchrun_executable(explicit: str | None) -> str:
    if explicit:
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return beside if os.path.exists(beside) else (shutil.which("torchrun") or "torchrun")


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of the local run, after validating the config for this world."""
    files = [args.recipe, *args.layout]
    cfg = from_dict(*compose(files, args.overrides), validate=False)  # sizes only; validated below
    nproc = args.nproc or cfg.parallel.gpus_per_node
    overrides = list(args.overrides)
    if cfg.parallel.nodes != 1:
        overrides.append("parallel.nodes=1")
    if nproc != cfg.parallel.gpus_per_node:
        overrides.append(f"parallel.gpus_per_node={nproc}")
    check_loggers(check_config(files, overrides, nproc))  # this machine runs the job: its packages, its network
    cmd = [torchrun_executable(args.torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "-m", TRAIN_MODULE, *train_args(args.recipe, args.layout, overrides)]
    return cmd, parse_env(args.env)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cmd, env = build_command(args)
    except (ConfigError, LoggerError) as e:
        return fail(f"config: {e}")
    if args.dryrun:
        for key, value in env.items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"cd {shlex.quote(REPO)}")
        print(shlex.join(cmd))
        return 0
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
