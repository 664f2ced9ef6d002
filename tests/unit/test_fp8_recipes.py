"""FP8 recipes a GPU cannot run are refused when the model is built, naming model.fp8_recipe, by
Transformer Engine 2.11's own support rules (transformer_engine/pytorch/quantization.py)."""

import pytest

from megarl.models.fp8 import unsupported_reason

H100 = (9, 0)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_hopper_runs_the_three_recipes_megarl_offers_it(recipe):
    assert unsupported_reason(recipe, H100, "13.0") is None


def test_mxfp8_is_refused_on_hopper_with_the_reason():
    why = unsupported_reason("mxfp8", H100, "13.0")
    assert "compute capability 10.x" in why and "sm 9.0" in why and "delayed, tensorwise or blockwise" in why


@pytest.mark.parametrize("capability, ok", [((10, 0), True), ((10, 3), True), ((12, 0), False), ((8, 9), False)])
def test_mxfp8_runs_on_datacenter_blackwell_only(capability, ok):
    assert (unsupported_reason("mxfp8", capability, "13.0") is None) == ok


@pytest.mark.parametrize("cuda, ok", [("12.9", True), ("13.0", True), ("12.8", False), (None, False)])
def test_blockwise_needs_cuda_12_9(cuda, ok):
    assert (unsupported_reason("blockwise", H100, cuda) is None) == ok


@pytest.mark.parametrize("capability, cuda, ok", [((8, 9), "12.1", True), ((8, 9), "12.0", False),
                                                  ((8, 6), "13.0", False), ((8, 0), "13.0", False)])
def test_per_tensor_recipes_before_hopper(capability, cuda, ok):
    for recipe in ("delayed", "tensorwise"):
        assert (unsupported_reason(recipe, capability, cuda) is None) == ok


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'e5m2'"):
        unsupported_reason("e5m2", H100, "13.0")


def test_check_reads_the_gpu_of_this_process(monkeypatch):
    """megarl.models.builder.transformer_config calls it for every model built with fp8 set
    (trainer, bench, smoke); without CUDA it checks nothing."""
    import torch

    from megarl.models import fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ValueError, match=r"model\.fp8_recipe=mxfp8: MXFP8 block scaling needs compute capability 10"):
        fp8.check_fp8_recipe("mxfp8")
    fp8.check_fp8_recipe("blockwise")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fp8.check_fp8_recipe("mxfp8")
