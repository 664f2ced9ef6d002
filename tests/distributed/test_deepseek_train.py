"""DeepSeek-V3 (multi-latent attention) and GLM-4.5 training through the trainer on 4 gloo ranks (strict
device mode), one launch (tests/distributed/scripts_deepseek_train.py): PPO updates at TP1xEP2 and
TP2xEP2 (sequence parallelism) equal TP1xEP1's on packed batches, the selection bias frozen by
default and moving with model.moe_expert_bias_update_rate, and routing replay of the builtin
engine's experts (dense first layer included) with the MoE metrics."""

import math

import pytest
import torch

from tests.distributed.launch import run_worker

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo test")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_worker("scripts_deepseek_train.py", 4, tmp_path_factory.mktemp("deepseek_train"), timeout=1500)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("layout", ["tp1_ep2", "tp2_ep2"])
def test_expert_and_tensor_parallel_updates_equal_ep1(result, family, layout):
    ref, got = result["layouts"][family]["tp1_ep1"], result["layouts"][family][layout]
    assert ref["microbatches"] > 1  # gradient accumulation over packed micro-batches
    assert max(abs(a - b) for x, y in zip(got["old_logprobs"], ref["old_logprobs"]) for a, b in zip(x, y)) < 1e-5
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], abs=1e-6)  # the first update moved the policy
    for key in ("losses", "grad_norms"):
        for g, r in zip(got[key], ref[key]):
            assert math.isfinite(r) and rel(g, r) < 1e-5, (family, layout, key, g, r)
    assert ref["grad_norms"][0] > 0.05  # clip_grad=0.05 is active
    assert got["n_tensors"] > 80 and got["weights_max_rel_diff"] < 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_selection_bias_stays_frozen_by_default(result, family):
    for layout in ("tp1_ep1", "tp1_ep2", "tp2_ep2"):
        r = result["layouts"][family][layout]
        assert r["n_biases"] == 3 and r["biases_moved"] == 0


def test_bias_update_rate_moves_the_bias(result):
    """model.moe_expert_bias_update_rate (megatron moe_router_bias_update_rate) > 0: every MoE layer's
    bias moves after the updates (aux-loss-free balancing)."""
    r = result["bias_rate"]
    assert r["n_biases"] == 3 and r["biases_moved"] == 3


def test_replay_on_same_weights_matches_engine_logprobs(result):
    r = result["replay"]["same_weights_tp2_ep2"]
    assert result["replay"]["routed_shape"][1:] == [4, 4]  # every layer (dense layer 0 included), top-4
    assert r["tokens"] > 40
    assert r["moe/replayed_fraction"] == 1.0 and r["moe/routing_agreement"] == 1.0
    assert r["logprob_max_abs_diff"] < 1e-5


def test_replay_makes_perturbed_routers_route_like_the_engine(result):
    r = result["replay"]
    off, on = r["perturbed_tp1_ep2_off"], r["perturbed_tp2_ep2_on"]
    assert off["moe/routing_agreement"] < 0.9  # the perturbed sigmoid routers disagree with the engine
    assert off["own_used_equal_engine"] == pytest.approx(off["moe/routing_agreement"], abs=1e-12)
    assert on["moe/replayed_fraction"] == 1.0 and on["moe/routing_agreement"] < 0.9
    assert math.isfinite(on["loss"]) and on["grad_norm"] > 0
