"""Strict device mode: the CPU suite fails where a GPU run would (megarl.parallel.strict_device).

The misplaced tensors below are the GPU path's first-step defects as they were (host
micro-batches into a model on the GPU, host tensors in NCCL-group collectives); the same code
with device tensors passes, and a full train step plus a weight stream run clean.
"""

import pytest

from tests.distributed.launch import REPO, run_python, tiny_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    tiny_model(root / "model")
    return run_python("scripts_strict_device.py", root, timeout=300,
                      env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def test_model_params_live_on_the_device(result):
    assert result["params_on_device"]


def test_host_microbatch_into_device_model_fails(result):
    assert "expected all tensors on the same device" in result["host_microbatch_into_model"]
    assert result["device_microbatch_into_model"] is None


def test_host_tensor_in_nccl_collective_fails(result):
    assert "NCCL group" in result["host_tensor_dp_all_reduce"]
    assert result["device_tensor_dp_all_reduce"] is None
    assert result["host_tensor_gloo_group"] is None  # gloo groups take host tensors on a GPU too


def test_gpu_only_operations_fail(result):
    assert "numpy" in result["numpy_of_device_tensor"]
    assert "same device" in result["loss_with_host_mask"]


def test_train_step_and_weight_stream_run_on_the_device(result):
    assert result["train_step_grad_norm"] > 0
    assert result["streamed_tensors"] > 0 and result["streamed_on_device"]
    assert result["logprobs_on_host"]  # forward_only hands the step batch host tensors


def test_fp16_losses_are_scaled_by_the_optimizers_loss_scale(result):
    assert result["fp16_scales_loss"] and result["fp16_loss_scale"] > 1.0


def test_entropy_follows_loss_agg_and_whitening_skips_filtered_tokens(result):
    assert result["entropy_seq_mean"] == pytest.approx(result["entropy_seq_mean_expected"], rel=1e-5)
    assert result["whitened_mean"] == pytest.approx(0.0, abs=1e-6)
    assert result["whitened_var"] == pytest.approx(1.0, rel=1e-4)
