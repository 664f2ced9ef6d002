"""Rollout engines shared by several ranks (SGLang rollout_tp): groups and prompt sharding, 4 gloo ranks."""

from collections import Counter

import pytest

from tests.distributed.launch import run_worker, tiny_model


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    tiny_model(root / "model", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    return run_worker("scripts_rollout_groups.py", 4, root)


def test_engine_groups_and_sharding(parts):
    assert [p["members"] for p in parts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    expected = Counter({f"u{i}": 3 for i in range(6)})  # every prompt once, n=3 samples each
    for per_engine in (1, 2):
        uids = [p[f"uids_{per_engine}"] for p in parts]
        assert all(u == uids[0] for u in uids), per_engine  # every rank sees the same batch
        assert Counter(uids[0]) == expected, per_engine
        assert all(p[f"scored_{per_engine}"] == 18.0 for p in parts), per_engine  # scored once, summed over ranks
    asked = [p["asked_1"] for p in parts]  # one engine per rank: four disjoint shares
    assert sorted(q for a in asked for q in a) == sorted(f"Q: {i}+{i}=?\n" for i in range(6))
    assert [p["held_1"] for p in parts] == [6, 6, 3, 3]  # each rank keeps what it generated (2, 2, 1, 1 prompts)
    assert all(p["sources_1"] == [0, 1, 2, 3] for p in parts)
    asked = [p["asked_2"] for p in parts]  # one engine per pair: only its owner asks, for the pair's share
    assert asked[1] == asked[3] == [] and asked[0] and asked[2] and not set(asked[0]) & set(asked[2])
    assert sorted(asked[0] + asked[2]) == sorted(f"Q: {i}+{i}=?\n" for i in range(6))
    assert [p["held_2"] for p in parts] == [9, 0, 9, 0]  # the samples stay on the owners
    assert all(p["sources_2"] == [0, 2] for p in parts)
    assert [p["raised"] for p in parts] == ["engine failed on purpose"] * 4


def test_lockstep_gives_every_rank_of_an_engine_the_same_rounds(parts):
    for owner, other in ((parts[0], parts[1]), (parts[2], parts[3])):
        assert owner["lockstep"] == [[1, True], [1, True], [1, False]]  # its 3 buckets; more after all but the last
        assert other["lockstep"] == [[1, True], [0, True], [0, False]]  # its 1, then empty rounds


def test_an_sglang_engine_over_two_nodes_starts_on_each_nodes_first_rank(parts):
    for pair in ((parts[0], parts[1]), (parts[2], parts[3])):
        (mine,), (theirs,) = (p["nodes"]["fail0"]["made"] for p in pair)
        assert (mine["node_rank"], theirs["node_rank"]) == (0, 1) and mine["nnodes"] == theirs["nnodes"] == 2
        assert mine["addr"] == theirs["addr"] and ":" in mine["addr"]  # both join the owner's address
        assert (mine["follower_env"], theirs["follower_env"]) == (None, "0")
        assert pair[0]["nodes"]["fail0"]["owner_engine"] and not pair[1]["nodes"]["fail0"]["owner_engine"]
        assert all(p["nodes"]["fail0"]["env_after"] is None for p in pair)  # the flag does not outlive the start
        assert all("node 1" in p["nodes"]["fail1"]["raised"] for p in pair)  # a failing node raises on both ranks