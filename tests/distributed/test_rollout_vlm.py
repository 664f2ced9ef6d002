"""Issue 15 (rollout, qwen2_5_vl): the Megatron Qwen2.5-VL's weight stream at TP=2 (2 gloo ranks,
strict device mode) carries the vision tower and merger into the builtin engine, whose log-probs
when sampling / decoding with images equal the Megatron model's log-probs of the same sequences
(tests/distributed/scripts_rollout_vlm.py)."""

import pytest

from tests.distributed.launch import CPU_ONLY, worker_fixture

pytestmark = CPU_ONLY
TOL = 1e-5
results = worker_fixture("scripts_rollout_vlm.py", 2)


def test_stream_carries_vision_tower_and_merger_at_tp2(results):
    s = results["stream"]
    # patch embed + 12 per block x 2 + merger 5; LM: embed, norm, 12 per layer x 2, lm_head
    assert len(s["visual"]) == 30 and s["n"] == 30 + 27
    assert s["names"] == s["engine_params"]  # every engine parameter came by its HF name
    assert s["buckets"] > 1
    assert results["weight_version"] == 2  # from_pretrained + one streamed update


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_engine_logprobs_with_images_equal_megatron(results, mode):
    r = results[mode]
    assert r["n_tokens"] >= (36 if mode == "sampled" else 18)
    assert r["with_images"] == (4 if mode == "sampled" else 2)
    assert r["logprob_max_abs_diff"] < TOL, r


def test_streamed_weights_matter(results):
    assert results["stale_differs"]  # the stream, not the HF files, set the engine's weights
    assert results["stale_vision_first_logprob_diff"] > 1e-3  # and the tower's streamed weights are used
