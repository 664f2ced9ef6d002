"""TrainModel.offload / onload on CPU, under strict device mode with its host-offload model
(megarl.parallel.host_offload), 2 gloo ranks: every optimizer setup the trainer offers.

What this covers: the GPU <-> host moves as copies into new storage, `.data` assigned across
devices resetting a parameter's gradient accumulator (as torch does on a GPU: megatron DDP's grad
hook is lost), the distributed optimizer's parameter shards as views of DDP's parameter buffer,
megatron's HybridDeviceOptimizer (its CPU Adam and the copy of each update into those views),
which storage holds the weights while offloaded, and the weight sync's two-stage offload (only
the weights on the device while they stream). What only a GPU covers (tools/gpu_smoke.py, checks
`offload` and `offload_plain`): real GPU memory freed, pinned-memory and non-blocking copies, and
Transformer Engine's modules.
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


@pytest.mark.parametrize("case", ("plain_bf16", "plain_fp32", "distributed_bf16"))
def test_round_trip_keeps_the_gradient_accumulators_ddp_hooked(result, case):
    """On a GPU `p.data = p.data.cpu()` resets each parameter's gradient accumulator (torch's
    set_data, modelled by host_offload): DDP's hook, which fills main_grad, is gone and the
    optimizer steps on zero gradients. The storage moves in place instead."""
    r = result[case]
    assert r["accumulators_kept"] == [True, True, True], r
    assert all(g > 1e-6 for g in r["main_grad_norm"]), r["main_grad_norm"]


@pytest.mark.parametrize("case", ("sync_distributed_bf16", "sync_plain_bf16"))
def test_weight_sync_streams_with_only_the_weights_on_the_device(result, case):
    """rollout.offload_train_state: gradients and optimizer state leave before the engine's
    weights come back (the reference model entirely); the weights leave for generation; all of
    it returns for training, which goes on as if nothing had moved."""
    r = result[case]
    trained = r["trained"]["actor"]
    assert trained["weights"] > 0 and trained["grads"] > 0 and trained["optimizer"] > 0, r
    assert r["trained"]["ref_weights"] > 0
    assert r["stream"], r  # the engine saw the stream
    for seen in r["stream"] + [r["after_sync"]]:
        assert seen["actor"] == {"weights": trained["weights"], "grads": 0, "optimizer": 0}, seen
        assert seen["ref_weights"] == 0, seen
    assert r["generation"] == {"actor": {"weights": 0, "grads": 0, "optimizer": 0}, "ref_weights": 0}
    assert r["after_generation"] == r["trained"]
    assert r["engine_equal"]
    assert r["twin_diff"] < 1e-6, r["twin_diff"]


@pytest.mark.parametrize("case", ("sync_distributed_bf16_from_host", "sync_plain_bf16_from_host"))
def test_weight_sync_from_host_streams_with_nothing_of_the_trainer_on_the_device(result, case):
    """rollout.sync_from_host: the actor's weights leave with the rest before the engine's weights
    come back and stream from their host copies (each bucket copied in); the engine gets the
    trainer's weights exactly, and training goes on as if nothing had moved."""
    r = result[case]
    trained = r["trained"]["actor"]
    assert trained["weights"] > 0 and r["stream"], r
    for seen in r["stream"] + [r["after_sync"]]:
        assert seen == {"actor": {"weights": 0, "grads": 0, "optimizer": 0}, "ref_weights": 0}, seen
    assert r["after_generation"] == r["trained"]
    assert r["engine_equal"]
    assert r["twin_diff"] < 1e-6, r["twin_diff"]


def test_gpu_smoke_offload_plain_check_passes_on_the_cpu_model(result):
    """tools/gpu_smoke.py's offload_plain check (tools/smoke/offload.py), run here on the CPU model."""
    r = result["smoke_offload_plain"]
    assert r["ok"], r["detail"]
    assert "accumulators kept" in r["detail"] and "state" in r["detail"], r["detail"]
