"""A lost rank ends the job: `megarl train` on 2 gloo ranks (started directly, without torchrun,
so nothing but megarl itself ends the survivor); rank 1 is killed (SIGKILL: its sockets close)
or frozen (SIGSTOP: a vanished node, nothing closes) on entering its first actor update. Rank 0
must exit with a CollectiveError naming the phase, within parallel.collective_timeout_s."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.distributed.launch import REPO, free_port, rl_files, rl_overrides

TIMEOUT_S = 10.0
SLACK_S = 20.0  # process exit and a loaded 2-core machine


@pytest.fixture(scope="module")
def job_files(tmp_path_factory):
    return rl_files(tmp_path_factory.mktemp("lost_rank"), n_sft=4, n_train=16, n_eval=2)


def _launch(root, run_dir, kill_at: str) -> list[subprocess.Popen]:
    overrides = rl_overrides(root, eval_set=False) + [
        "data.max_prompt_len=32", "parallel.tp=2", "parallel.nodes=1", "parallel.gpus_per_node=2",
        f"parallel.collective_timeout_s={TIMEOUT_S}", "rollout.max_new_tokens=8",
        "algorithm.mini_batch_size=4", "actor.max_tokens_per_microbatch=64", "trainer.total_steps=2",
        "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.tensorboard=false", f"trainer.run_dir={run_dir}",
    ]
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=str(REPO), MEGARL_CHAOS_KILL_AT=kill_at)
        cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(REPO / "configs/algorithms/grpo.yaml"),
               *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _lost(proc: subprocess.Popen, how: str) -> bool:
    if how == "SIGKILL":
        return proc.poll() is not None
    try:
        return psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_ends_the_other_within_the_timeout_naming_the_phase(job_files, tmp_path, how):
    survivor, victim = _launch(job_files, tmp_path / "run", f"actor_update:1@1:{how}")
    lost_at = ended_at = None
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and ended_at is None:
            now = time.monotonic()
            if lost_at is None and _lost(victim, how):
                lost_at = now
            if survivor.poll() is not None:
                ended_at = now
            time.sleep(0.05)
        assert lost_at is not None, "the fault hook never fired"
        assert ended_at is not None, "the surviving rank hangs"
        _, err = survivor.communicate(timeout=30)
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
    waited = ended_at - lost_at
    print(f"{how}: rank 0 ended {waited:.1f} s after rank 1 was lost:",
          next(line for line in err.splitlines() if "CollectiveError:" in line)[:300])
    assert survivor.returncode != 0
    assert "CollectiveError: rank 0: a collective failed during phase 'actor_update'" in err, err[-3000:]
    assert f"parallel.collective_timeout_s={TIMEOUT_S:g}" in err and "trainer.resume=true" in err
    assert waited <= TIMEOUT_S + SLACK_S, waited
    if how == "SIGSTOP":  # nothing closed: only the timeout can have ended the survivor
        assert waited >= TIMEOUT_S * 0.9, waited
        assert "Timed out" in err
    else:  # gloo saw the closed socket at once
        assert "Connection closed by peer" in err or "Connection reset by peer" in err
