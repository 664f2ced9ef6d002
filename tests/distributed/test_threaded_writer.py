"""megarl.weights.threaded_writer: megatron's torch_dist save writes every rank's shards without
forking (os.fork raises in the workers), and what it wrote loads back exactly; megatron's own
writer forks (the same script without the threaded writer fails), so the check can fail."""

from tests.distributed.launch import REPO, run_torchrun

SCRIPT = REPO / "tests/distributed/scripts_threaded_writer.py"


def test_torch_dist_save_writes_every_rank_from_threads_and_loads_back(tmp_path):
    ranks = run_torchrun(SCRIPT, 2, ["--root", str(tmp_path)], tmp_path / "out.json", timeout=300)
    assert [r.get("error") for r in ranks] == [None, None]
    assert all(r["equal"] for r in ranks)
    files = ranks[0]["files"]
    assert ".metadata" in files
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)


def test_megatrons_own_writer_forks(tmp_path):
    ranks = run_torchrun(SCRIPT, 2, ["--root", str(tmp_path), "--threaded", "0"], tmp_path / "out.json", timeout=300)
    assert any("forked" in (r.get("error") or "") for r in ranks)
