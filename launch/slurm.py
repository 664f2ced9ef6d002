#!/usr/bin/env python
"""Submit a megarl training run to Slurm with nemo-run (pyxis containers, torchrun launcher).

    python launch/slurm.py --recipe configs/recipes/qwen2.5-32b/dapo.yaml \
        --layout configs/layouts/qwen2.5-32b/16node.yaml --nodes 16 \
        --account ACCOUNT --partition PARTITION --container IMAGE \
        --mounts /lustre/models:/models --mounts /lustre/data:/data [--dryrun] [key=value ...]

Run it on a login node (it calls sbatch through a nemo-run LocalTunnel; no SSH). The job runs
``torchrun ... -m megarl.cli train --config RECIPE [--config LAYOUT] overrides`` on every node,
inside the container, in the working directory nemo-run prepares: by default the committed HEAD
of this repository (git archive), or ``--code-dir`` (a checkout already on the shared filesystem).
``--dryrun`` prints the sbatch script that nemo-run renders, and submits nothing. Every process
of the job gets launch_common.DEFAULT_ENV (CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_CUMEM_ENABLE=0,
...) plus the ``--env`` pairs.

Failures: the script is submitted with ``--requeue``; when the job exits non-zero, nemo-run's
script requeues it up to ``--retries`` times, and the recipes' ``trainer.resume=true`` continues
from the latest checkpoint in ``trainer.run_dir`` (which must be on a mounted shared filesystem).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_common import TRAIN_MODULE, ConfigError, add_common_arguments, check_config, fail  # noqa: E402
from launch_common import git_is_dirty, compose, from_dict, parse_env, train_args  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap)
    ap.add_argument("--nodes", type=int, help="nodes (default: parallel.nodes of the config; otherwise passed as an override)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: parallel.gpus_per_node)")
    ap.add_argument("--account", required=True)
    ap.add_argument("--partition")
    ap.add_argument("--qos")
    ap.add_argument("--container", required=True, help="container image (pyxis / enroot), e.g. a build of this repo's Dockerfile")
    ap.add_argument("--mounts", action="append", default=[], metavar="SRC:DST", help="container mount (repeatable)")
    ap.add_argument("--time", default="04:00:00", help="Slurm time limit")
    ap.add_argument("--retries", type=int, default=3, help="requeue the job this many times after a failure")
    ap.add_argument("--signal", help="sbatch --signal, e.g. USR1@300 (only if the trainer handles it)")
    ap.add_argument("--mem", help="sbatch --mem (e.g. 0 = all memory of the node)")
    ap.add_argument("--no-exclusive", dest="exclusive", action="store_false", help="do not ask for whole nodes")
    ap.add_argument("--job-dir", default=os.path.join(os.getcwd(), "runs", "nemo_run"),
                    help="nemo-run job directory on the shared filesystem (logs, sbatch script, code)")
    ap.add_argument("--job-name", help="experiment name (default: <model dir>-<recipe name>)")
    ap.add_argument("--code-dir", help="use this checkout on the shared filesystem instead of packaging git HEAD")
    ap.add_argument("--rdzv-port", type=int, default=29500)
    return ap


def experiment_name(args: argparse.Namespace) -> str:
    if args.job_name:
        return args.job_name
    recipe = os.path.abspath(args.recipe)
    return f"{os.path.basename(os.path.dirname(recipe))}-{os.path.splitext(os.path.basename(recipe))[0]}"


def resolve(args: argparse.Namespace) -> tuple[list[str], int, int]:
    """Validated (overrides for the job, nodes, gpus per node). The node count given on the command
    line wins over the layout's and is passed on as parallel.nodes so the job sees the same config."""
    files = [args.recipe, *args.layout]
    cfg = from_dict(*compose(files, args.overrides), validate=False)  # sizes only; validated below
    overrides = list(args.overrides)
    nodes = args.nodes or cfg.parallel.nodes
    gpus = args.gpus_per_node or cfg.parallel.gpus_per_node
    if nodes != cfg.parallel.nodes:
        overrides.append(f"parallel.nodes={nodes}")
    if gpus != cfg.parallel.gpus_per_node:
        overrides.append(f"parallel.gpus_per_node={gpus}")
    final = check_config(files, overrides, nodes * gpus)
    if not os.path.isabs(final.trainer.run_dir):
        print(f"warning: trainer.run_dir={final.trainer.run_dir} is relative to the job's packaged code directory; "
              "set it to a mounted shared path so a new submission can resume", file=sys.stderr)
    return overrides, nodes, gpus


def build(args: argparse.Namespace, overrides: list[str], nodes: int, gpus: int):
    """The nemo-run (executor, script) pair for this submission."""
    import nemo_run as run

    job_dir = os.path.abspath(args.job_dir)
    mounts = list(args.mounts)
    if args.code_dir:
        # nemo-run links <job dir>/code -> code_dir; the target must exist inside the container too
        code_dir = os.path.abspath(args.code_dir)
        packager = run.Packager(symlink_from_remote_dir=code_dir)
        mounts.append(f"{code_dir}:{code_dir}")
    else:
        packager = run.GitArchivePackager(ref="HEAD")
    name = experiment_name(args)
    executor = run.SlurmExecutor(
        account=args.account,
        partition=args.partition,
        qos=args.qos,
        job_name_prefix="megarl-",
        nodes=nodes,
        ntasks_per_node=gpus,  # the torchrun launcher turns this into 1 task and --nproc-per-node
        gpus_per_node=gpus,
        exclusive=True if args.exclusive else None,
        mem=args.mem,
        time=args.time,
        signal=args.signal,
        container_image=args.container,
        container_mounts=mounts,
        env_vars=parse_env(args.env),
        tunnel=run.LocalTunnel(job_dir=job_dir),
        packager=packager,
        launcher=run.Torchrun(rdzv_port=args.rdzv_port, rdzv_id=zlib.crc32(name.encode()) % 10000),
    )
    executor.retries = args.retries
    # nemo-run shell-quotes each argument when it writes the srun line
    script = run.Script(path=TRAIN_MODULE, args=train_args(args.recipe, args.layout, overrides), m=True,
                        entrypoint="python")
    return executor, script, name


def render_sbatch(args: argparse.Namespace) -> str:
    """Render the sbatch script with nemo-run's own SlurmBatchRequest (an Experiment dry run) and
    remove the experiment folders the dry run created."""
    import nemo_run as run

    overrides, nodes, gpus = resolve(args)
    executor, script, name = build(args, overrides, nodes, gpus)
    job_dir = os.path.abspath(args.job_dir)
    with run.Experiment(name, executor=executor, base_dir=job_dir, log_level="WARN") as exp:
        exp.add(script, name=name)
        exp.dryrun(log=False, delete_exp_dir=False)
        exp_dir, exp_id = exp._exp_dir, exp._id
    try:
        scripts = sorted(glob.glob(os.path.join(exp_dir, "*_sbatch.sh")))
        if len(scripts) != 1:
            raise RuntimeError(f"nemo-run dry run wrote {len(scripts)} sbatch scripts in {exp_dir}, expected 1")
        with open(scripts[0], encoding="utf-8") as f:
            return f.read()
    finally:
        shutil.rmtree(exp_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(job_dir, name, exp_id), ignore_errors=True)
        for leftover in (os.path.dirname(exp_dir), os.path.join(job_dir, name)):
            if os.path.isdir(leftover) and not os.listdir(leftover):
                os.rmdir(leftover)


def submit(args: argparse.Namespace) -> str:
    import nemo_run as run

    overrides, nodes, gpus = resolve(args)
    executor, script, name = build(args, overrides, nodes, gpus)
    if not args.code_dir and git_is_dirty():
        print("warning: uncommitted changes are not packaged (git archive HEAD); commit them or use --code-dir",
              file=sys.stderr)
    with run.Experiment(name, executor=executor, base_dir=os.path.abspath(args.job_dir)) as exp:
        exp.add(script, name=name)
        exp.run(detach=True)
        return exp._id


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.dryrun:
            print(render_sbatch(args))
        else:
            exp_id = submit(args)
            print(f"submitted experiment {exp_id}; logs under {os.path.abspath(args.job_dir)}")
    except ConfigError as e:
        return fail(f"config: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
