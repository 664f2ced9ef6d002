"""TrainModel.offload / onload on CPU, under strict device mode with its host-offload model
(megarl.parallel.host_offload), 2 gloo ranks: every optimizer setup the trainer offers.

What this covers: the GPU <-> host moves as copies into new storage, the distributed optimizer's
parameter shards as views of DDP's parameter buffer, megatron's HybridDeviceOptimizer (its CPU
Adam and the copy of each update into those views), and which storage holds the weights while
offloaded. What only a GPU covers (tools/gpu_smoke.py, check `offload`): real GPU memory freed,
pinned-memory and non-blocking copies, and Transformer Engine's modules.
"""

import pytest

from tests.distributed.launch import run_worker, tiny_model

TRAINED = ("hybrid_bf16", "distributed_fp32", "distributed_bf16", "plain_bf16", "plain_fp32")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    tiny_model(root / "model")
    return run_worker("scripts_offload.py", 2, root, "--cases", ",".join(TRAINED))


def test_hybrid_optimizer_updates_reach_the_next_forward_after_each_round_trip(result):
    """offload_optimizer=true: the updates land in DDP's parameter buffer, which the forward reads
    (megatron's own optimizer offload cut the parameter shards off it: training stopped)."""
    r = result["hybrid_bf16"]
    assert all(m > 1e-3 for m in r["forward_moved"]), r  # the step after the round trip changed the forward
    assert all(d < 1e-6 for d in r["twin_diff"]), r  # exactly as if never offloaded
    assert all(o["views_of_buffer"] > 0 and o["own_device_bytes"] == 0 for o in r["optimizer_params"]), r
    assert r["error"] is None and len(r["twin_diff"]) == 3, r


def test_fp32_distributed_optimizer_shards_stay_views_of_the_buffer(result):
    """No second device copy of this rank's 1/DP of the weights after an onload."""
    r = result["distributed_fp32"]
    assert all(o["views_of_buffer"] > 0 and o["own_device_bytes"] == 0 for o in r["optimizer_params"]), \
        r["optimizer_params"]


def test_weights_leave_the_device_without_the_distributed_optimizer(result):
    """DDP has no parameter buffer then: the bf16 weights are moved one by one, and come back."""
    r = result["plain_bf16"]
    assert r["device_bytes_before"] > 0
    assert r["device_bytes_offloaded"] == [0, 0, 0]
    assert all(r["roundtrip_equal"])


@pytest.mark.parametrize("case", TRAINED)
def test_every_setup_offloads_its_weights_and_trains_like_a_twin_that_never_did(result, case):
    r = result[case]
    assert r["error"] is None, r
    assert r["device_bytes_before"] > 0 and r["device_bytes_offloaded"] == [0, 0, 0]
    assert all(r["roundtrip_equal"])  # same values, back on the device
    assert all(m > 1e-3 for m in r["forward_moved"])
    assert len(r["twin_diff"]) == 3 and all(d < 1e-6 for d in r["twin_diff"]), r["twin_diff"]


def test_forward_only_model_round_trip(result):
    assert result["reference"] == {"device_bytes_offloaded": 0, "forward_equal": True}


def test_offloaded_optimizer_refuses_fp32_weights(result):
    assert "bf16 or fp16" in result["hybrid_fp32_refused"]


def test_host_offload_model_copies_like_a_gpu(result):
    m = result["model"]
    assert m["cpu_is_host_copy"] and m["cuda_is_device_copy"] and m["pin_host_copy"] and m["pinned_factory_on_host"]
    assert "pin" in m["pin_device_error"]
