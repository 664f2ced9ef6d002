"""The weight stream at TP=2 x EP=2 with experts large against the bucket, 4 gloo ranks
(tests/distributed/scripts_weight_buckets.py): no collective of the stream moves more than one
bucket (before, one expert slot times EP was gathered: 1.6 GB at qwen3-235b-a22b against a 512 MiB
bucket), the builtin engine's weights after the sync equal the HF files bit for bit, and a rank
that wants only some experts gets exactly those."""

from tests.distributed.launch import CPU_ONLY, worker_fixture

pytestmark = CPU_ONLY
parts = worker_fixture("scripts_weight_buckets.py", 4, timeout=600, name="parts")


def test_no_collective_buffer_exceeds_the_bucket_and_the_engine_gets_every_weight(parts):
    for p in parts:
        s = p["sync"]
        assert 2 * s["fc1_bytes"] > s["bucket_bytes"] >= s["fc1_bytes"]  # one fc1 slot x EP would not fit
        assert s["largest_collective_buffer"] <= s["bucket_bytes"], s
        assert s["stats_largest"] <= s["bucket_bytes"] and s["buckets"] > 1
        assert s["names_equal_files"] and s["streamed_equal_files"]
        assert s["engine_equal_files"] and s["engine_tensors_checked"] > 20


def test_a_rank_receives_only_the_experts_it_wants(parts):
    for rank, p in enumerate(parts):
        s = p["selective"]
        assert s["experts"] == [rank, rank + 4] and s["only_experts"] and s["equal_files"]
        assert s["tensors"] == 2 * 2 * 3  # 2 layers x 2 experts x (gate, up, down)
        # it holds one of its two experts itself: the other comes over the wire, in each layer
        assert s["bytes_received"] == 2 * p["sync"]["expert_bytes"], s


def test_the_planners_sync_formula_matches_what_the_stream_allocates(parts):
    """megarl.planner.stream_transient_bytes at TP=2 x PP=2, for the busiest bucket's bytes, against
    the stream's own count on every rank (the owning stage holds shards, gathered shards, merged
    tensors and the broadcast buffer; other stages the buffer)."""
    from megarl.planner import stream_transient_bytes

    d = parts[0]["dense_tp2_pp2"]
    assert d["largest_bucket"] <= d["bucket_bytes"]
    predicted = stream_transient_bytes(d["largest_bucket"], 2, 2)
    peak = max(p["dense_tp2_pp2"]["peak"] for p in parts)
    assert abs(peak - predicted) <= 0.1 * predicted, (peak, predicted)
