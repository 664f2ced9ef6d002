"""Bad-input corpus, checkpoints (tests/distributed/scripts_bad_input.py, one gloo process through
megatron-core): a torch_dist checkpoint of another model, and one with a shard cut short, fail
to load with errors naming the checkpoint and the differing field / the short file."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.launch import REPO


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_ckpt")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(REPO / "tests/distributed/scripts_bad_input.py"), str(root),
                           str(root / "out.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, json.loads((root / "out.json").read_text())


def test_checkpoint_from_another_model_names_the_checkpoint_and_field(outcomes):
    root, res = outcomes
    assert res["same_model"] == "ok"
    assert res["other_model"].startswith(f"CheckpointError: checkpoint {root / 'ckpt_a'} holds another model: ")
    assert "hidden_size is 64 in its hf/config.json but 32 in the model being loaded" in res["other_model"]


def test_truncated_checkpoint_shard_names_the_file(outcomes):
    root, res = outcomes
    assert res["cut_shard"].startswith(f"CheckpointError: checkpoint {root / 'ckpt_cut'} is incomplete or corrupt: ")
    assert f"{res['cut_shard_path']}: {res['cut_shard_size']} bytes, the metadata needs" in res["cut_shard"]
