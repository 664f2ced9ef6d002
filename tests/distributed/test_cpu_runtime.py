"""megatron-core's own TP/PP/DP code on CPU through megarl's CPU runtime (4 gloo ranks)."""

import math

import pytest
import torch

from tests.distributed.launch import run_worker

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runtime test")


def test_layouts_train_identically(tmp_path):
    (tmp_path / "ckpt").mkdir()  # the worker's torch_dist checkpoint
    res = run_worker("scripts_cpu_runtime.py", 4, tmp_path)
    ref = res["tp1_pp1"]
    # loss must start near ln(vocab) (random model) and the clipped Adam step must lower it
    assert abs(ref["losses"][0] - math.log(96)) < 0.5
    assert ref["losses"][1] < ref["losses"][0]
    assert ref["grad_norms"][0] > 0.05  # clip_grad=0.05 is active
    for layout in ("tp2_pp2", "tp2_pp1", "tp1_pp2"):
        for a, b in zip(res[layout]["losses"], ref["losses"]):
            assert a == pytest.approx(b, abs=1e-5), layout
        for a, b in zip(res[layout]["grad_norms"], ref["grad_norms"]):
            assert a == pytest.approx(b, rel=1e-4), layout


def test_runtime_refuses_cuda(monkeypatch):
    from megarl.parallel import cpu_runtime

    if cpu_runtime.is_active():
        pytest.skip("already active in this process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_runtime.activate()
