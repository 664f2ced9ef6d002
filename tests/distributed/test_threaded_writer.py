"""megarl.weights.threaded_writer: megatron's torch_dist save writes every rank's shards without
forking (os.fork raises in the workers), and what it wrote loads back exactly; megatron's own
writer forks (the same script without the threaded writer fails), so the check can fail."""

from tests.distributed.launch import run_worker


def test_torch_dist_save_writes_every_rank_from_threads_and_loads_back(tmp_path):
    ranks = run_worker("scripts_threaded_writer.py", 2, tmp_path, timeout=300)
    assert [r.get("error") for r in ranks] == [None, None]
    assert all(r["equal"] for r in ranks)
    files = ranks[0]["files"]
    assert ".metadata" in files
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)


def test_megatrons_own_writer_forks(tmp_path):
    ranks = run_worker("scripts_threaded_writer.py", 2, tmp_path, "--threaded", 0, timeout=300)
    assert any("forked" in (r.get("error") or "") for r in ranks)
