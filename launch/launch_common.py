"""Shared pieces of the launchers: argument parsing, config check, the train command, env vars."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megarl.config import ConfigError, MegaRLConfig, compose, from_dict, load_config, validate_world  # noqa: E402,F401

TRAIN_MODULE = "megarl.cli"

# Set for every GPU job. CUDA_DEVICE_MAX_CONNECTIONS=1 keeps megatron's TP/SP communication kernels
# ordered ahead of compute (required for its comm/compute overlap); async error handling makes a
# failed NCCL collective abort the job (so Slurm can requeue it) instead of hanging to the timeout.
# NCCL_CUMEM_ENABLE=0 on every rank: SGLang runs its schedulers with 0 unless it is already set
# (srt/entrypoints/engine.py _set_envs_and_config), and the ranks of one NCCL communicator must
# agree on it, so it is set once for all processes instead of only where an engine starts.
DEFAULT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
}


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--recipe", required=True, help="recipe YAML (e.g. configs/recipes/qwen2.5-32b/dapo.yaml)")
    ap.add_argument("--layout", action="append", default=[], help="layout YAML composed after the recipe (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable (repeatable)")
    ap.add_argument("--dryrun", action="store_true", help="print what would run and exit")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides passed to megarl train")


def repo_relative(path: str) -> str:
    """Config paths as the job sees them: relative to the repository root when inside it (the job's
    working directory is the packaged repository), unchanged otherwise."""
    full = os.path.abspath(path)
    if full.startswith(REPO + os.sep):
        return os.path.relpath(full, REPO)
    return path


def check_config(config_files: list[str], overrides: list[str], world_size: int) -> MegaRLConfig:
    """Load + validate like the job will, and check the layout against the world size."""
    cfg = load_config(config_files, overrides)
    validate_world(cfg, world_size)
    return cfg


def train_args(recipe: str, layouts: list[str], overrides: list[str]) -> list[str]:
    """Arguments of ``python -m megarl.cli``: train --config RECIPE [--config LAYOUT ...] overrides."""
    args = ["train", "--config", repo_relative(recipe)]
    for layout in layouts:
        args += ["--config", repo_relative(layout)]
    return args + list(overrides)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = dict(DEFAULT_ENV)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def git_is_dirty() -> bool:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return bool(out.stdout.strip())


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2
