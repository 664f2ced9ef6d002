"""launch/slurm.py renders the sbatch script through nemo-run (dry run); launch/local.py builds torchrun."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = "/lustre/images/megarl-gpu.sqsh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"megarl_launch_{name}", os.path.join(REPO, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slurm():
    pytest.importorskip("nemo_run")
    return _load("slurm")


def dryrun(slurm, capsys, tmp_path, argv: list[str]) -> str:
    rc = slurm.main(["--account", "acct", "--partition", "batch", "--container", IMAGE,
                     "--mounts", "/lustre/models:/models", "--job-dir", str(tmp_path / "jobs"), "--dryrun", *argv])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "#!/bin/bash" in out
    return out[out.index("#!/bin/bash"):]


def srun_line(script: str) -> str:
    (line,) = [l for l in script.splitlines() if l.startswith("srun --output")]
    return line


@pytest.mark.parametrize(
    "nodes, recipe, layout",
    [
        (1, "configs/recipes/qwen2.5-7b/dapo.yaml", "configs/layouts/qwen2.5-7b/1node.yaml"),
        (8, "configs/recipes/qwen2.5-32b/dapo.yaml", "configs/layouts/qwen2.5-32b/8node.yaml"),
        (16, "configs/recipes/qwen2.5-32b/vapo.yaml", "configs/layouts/qwen2.5-32b/16node.yaml"),
    ],
)
def test_slurm_dryrun_sbatch(slurm, capsys, tmp_path, monkeypatch, nodes, recipe, layout):
    monkeypatch.chdir(REPO)
    overrides = ["actor.lr=2e-6", "trainer.run_dir=/lustre/runs/x"]
    script = dryrun(slurm, capsys, tmp_path, ["--recipe", recipe, "--layout", layout, "--nodes", str(nodes),
                                              "--code-dir", str(tmp_path / "checkout"), *overrides])
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))
    assert flags["nodes"] == str(nodes)
    assert flags["gpus-per-node"] == "8"
    assert flags["ntasks-per-node"] == "1"      # one torchrun agent per node
    assert flags["account"] == "acct" and flags["partition"] == "batch" and flags["time"] == "04:00:00"
    assert "exclusive" in flags
    line = srun_line(script)
    assert f"--container-image {IMAGE}" in line
    mounts = re.search(r"--container-mounts (\S+)", line).group(1).split(",")
    assert "/lustre/models:/models" in mounts and f"{tmp_path / 'checkout'}:{tmp_path / 'checkout'}" in mounts
    torchrun = line[line.index("torchrun"):]
    assert f"--nnodes {nodes} --nproc-per-node 8" in torchrun
    if nodes == 1:
        assert "--rdzv-endpoint localhost:0" in torchrun
    else:
        assert "--rdzv-backend c10d --rdzv-endpoint $head_node_ip:29500" in torchrun
        assert "--node-rank $SLURM_NODEID" in torchrun
        assert "head_node_ip=$(srun --nodes=1 --ntasks=1" in script
    assert torchrun.endswith(f"-m megarl.cli train --config {recipe} --config {layout} {' '.join(overrides)}")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert "export NCCL_CUMEM_ENABLE=0" in script  # every rank, not only the SGLang engine owners
    assert "export TORCHX_MAX_RETRIES=3" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "sbatch --requeue" in script
    # the dry run leaves nothing behind in the job directory
    assert not os.listdir(tmp_path / "jobs" / "experiments")


def test_slurm_node_count_from_layout_and_override_passthrough(slurm, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    # no --nodes: the recipe's own layout (16 nodes) decides
    script = dryrun(slurm, capsys, tmp_path, ["--recipe", "configs/recipes/qwen2.5-32b/dapo.yaml",
                                              "--code-dir", str(tmp_path), "--time", "12:00:00", "--retries", "5",
                                              "--env", "NCCL_IB_HCA=mlx5", "data.eval=[configs/eval/a.yaml]"])
    assert "#SBATCH --nodes=16" in script and "#SBATCH --time=12:00:00" in script
    assert "export TORCHX_MAX_RETRIES=5" in script and "export NCCL_IB_HCA=mlx5" in script
    assert srun_line(script).endswith("--config configs/recipes/qwen2.5-32b/dapo.yaml 'data.eval=[configs/eval/a.yaml]'")
    # --nodes different from the layout is forwarded so the job's config agrees with the allocation
    script = dryrun(slurm, capsys, tmp_path, ["--recipe", "configs/recipes/qwen2.5-32b/dapo.yaml", "--nodes", "32",
                                              "--code-dir", str(tmp_path)])
    assert "#SBATCH --nodes=32" in script
    assert srun_line(script).endswith("--config configs/recipes/qwen2.5-32b/dapo.yaml parallel.nodes=32")


def test_slurm_packages_git_head_by_default(slurm, capsys, tmp_path, monkeypatch):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    monkeypatch.chdir(REPO)
    devnull = open(os.devnull)
    monkeypatch.setattr(sys, "stdin", devnull)  # nemo-run runs `git archive` through invoke, which reads stdin
    try:
        script = dryrun(slurm, capsys, tmp_path, ["--recipe", "configs/recipes/qwen2.5-7b/grpo.yaml", "--nodes", "2"])
    finally:
        devnull.close()
    line = srun_line(script)
    assert "--container-workdir /nemo_run/code" in line  # the git archive of HEAD is the working directory
    assert "--nnodes 2 --nproc-per-node 8" in line


def test_slurm_refuses_a_layout_that_cannot_divide_the_world(slurm, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    rc = slurm.main(["--account", "a", "--container", IMAGE, "--job-dir", str(tmp_path), "--dryrun",
                     "--recipe", "configs/recipes/qwen2.5-32b/dapo.yaml", "--nodes", "1", "--gpus-per-node", "4",
                     "parallel.tp=8"])
    assert rc == 2
    assert "tp*pp*cp = 8*1*1 = 8 does not divide the world parallel.nodes*parallel.gpus_per_node = 4" in capsys.readouterr().err
    rc = slurm.main(["--account", "a", "--container", IMAGE, "--job-dir", str(tmp_path), "--dryrun",
                     "--recipe", "configs/recipes/qwen2.5-32b/dapo.yaml", "actor.learning_rate=1"])
    assert rc == 2 and "actor.learning_rate" in capsys.readouterr().err


def test_local_dryrun_command():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "local.py"), "--recipe", "configs/recipes/qwen2.5-7b/dapo.yaml",
         "--layout", "configs/layouts/qwen2.5-7b/1node.yaml", "--dryrun", "actor.lr=2e-6"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in lines
    assert "export NCCL_CUMEM_ENABLE=0" in lines
    cmd = lines[-1]
    assert re.search(r"torchrun --standalone --nnodes 1 --nproc-per-node 8 -m megarl.cli train "
                     r"--config configs/recipes/qwen2.5-7b/dapo.yaml --config configs/layouts/qwen2.5-7b/1node.yaml "
                     r"actor.lr=2e-6$", cmd), cmd


def test_local_world_override_and_refusal():
    local = _load("local")
    args = local.build_parser().parse_args(["--recipe", "configs/recipes/qwen2.5-7b/grpo.yaml", "--nproc", "4",
                                            "--torchrun", "torchrun"])
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        cmd, env = local.build_command(args)
        assert cmd[:6] == ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
        # the recipe's 4-node layout is brought to this one machine through overrides
        assert cmd[-2:] == ["parallel.nodes=1", "parallel.gpus_per_node=4"]
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"
        assert local.main(["--recipe", "configs/recipes/qwen2.5-7b/grpo.yaml", "--nproc", "2", "--dryrun"]) == 2
    finally:
        os.chdir(cwd)


def test_slurm_overrides_judged_at_the_requested_node_count(slurm, capsys, tmp_path, monkeypatch):
    """TP*PP = 64 does not fit the recipe's own 4-node layout (32 GPUs) but does fit --nodes 8."""
    monkeypatch.chdir(REPO)
    script = dryrun(slurm, capsys, tmp_path, ["--recipe", "configs/recipes/qwen2.5-7b/grpo.yaml", "--nodes", "8",
                                              "--code-dir", str(tmp_path), "parallel.tp=8", "parallel.pp=8"])
    assert "#SBATCH --nodes=8" in script
    assert srun_line(script).endswith("parallel.tp=8 parallel.pp=8 parallel.nodes=8")
