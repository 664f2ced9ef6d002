"""PromptSampler determinism / resume, and shard_for_rank."""

import json
import random

import pytest

from megarl.data import PromptSampler, shard_for_rank


def _order(seed):
    o = list(range(5))
    random.Random(seed).shuffle(o)
    return o


def test_order_wraps_and_reshuffles_per_epoch():
    s = PromptSampler(list(range(5)), batch_prompts=3, seed=7)
    stream = [s.next_batch() for _ in range(4)]
    flat = _order(7) + _order(8) + _order(9)  # epoch e uses Random(seed + e)
    assert stream == [flat[0:3], flat[3:6], flat[6:9], flat[9:12]]
    assert _order(7) != _order(8)
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 2


def test_no_shuffle_is_identity_order():
    s = PromptSampler(["a", "b", "c"], batch_prompts=2, seed=0, shuffle=False)
    assert [s.next_batch() for _ in range(3)] == [["a", "b"], ["c", "a"], ["b", "c"]]


def test_resume_reproduces_stream():
    data = [f"p{i}" for i in range(11)]
    ref = PromptSampler(data, batch_prompts=4, seed=3)
    expected = [ref.next_batch() for _ in range(9)]
    first = PromptSampler(data, batch_prompts=4, seed=3)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # JSON-serialisable
    resumed = PromptSampler(data, batch_prompts=4, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == expected[5:]


def test_resume_mismatch_and_bad_args():
    s = PromptSampler(list(range(10)), batch_prompts=2, seed=1)
    with pytest.raises(ValueError, match="dataset_size=10"):
        PromptSampler(list(range(9)), batch_prompts=2, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed=1"):
        PromptSampler(list(range(10)), batch_prompts=2, seed=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="exceeds the dataset size"):
        PromptSampler([1, 2], batch_prompts=3, seed=0)


def test_shard_for_rank():
    items = list(range(7))
    shards = [shard_for_rank(items, r, 3) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError):
        shard_for_rank(items, 3, 3)
