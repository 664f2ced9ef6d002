"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (hybrid gated delta-net / gated attention, MoE, vision) HF <->
Megatron on 4 gloo ranks, one launch (tests/distributed/scripts_hybrid.py): `megarl convert verify
--packed --grad` at TP2, EP2, PP2 (stages of different layer kinds) and TP2xEP2, bit-exact
HF -> Megatron -> HF streams, every delta-net layer against HF's on the same inputs at TP1 and TP2,
packed sequences independent of each other, torch_dist saved at TP2 loaded at TP1, the builtin
engine's log-probs equal to the actor's after a TP2 x EP2 weight stream (images for Qwen3.5-MoE)."""

import pytest
import torch

from tests.distributed.launch import run_worker
from tests.distributed.scripts_hybrid import DENSE_LAYOUTS, FAMILIES, LAYOUTS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo test")


def _names(layouts):
    return [f"tp{tp}_pp{pp}_ep{ep}" for tp, pp, ep in layouts]


def _layouts(family):
    return _names(DENSE_LAYOUTS if family == "qwen3_5" else LAYOUTS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker("scripts_hybrid.py", 4, tmp_path_factory.mktemp("hybrid"), timeout=1500)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_logits_and_gradients_at_every_layout(results, family):
    assert set(results["verify"][family]) == set(_layouts(family))
    for layout, r in results["verify"][family].items():
        assert r["rc"] == 0, (family, layout, r)
        assert r["max_abs_logit_diff"] < 1e-4 and r["max_rel_grad_diff"] < 1e-4, (family, layout, r)
        assert r["max_rel_grad_diff"] > 0  # gradients were compared


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_is_bit_exact_at_every_layout(results, family):
    for layout in _layouts(family):
        r = results["roundtrip"][family][layout]
        assert r["exact_all_ranks"], (family, layout, r)
        assert r["buckets"] > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_delta_net_layer_equals_transformers_on_the_same_inputs(results, family):
    for tp in ("tp1", "tp2"):
        layers = results["layer"][family][tp]
        assert set(layers) == {"0", "1", "2"}  # the three linear-attention layers
        for i, r in layers.items():
            assert r["diff"] <= 1e-5 and r["scale"] > 0.5, (family, tp, i, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_sequence_does_not_see_the_ones_before_it(results, family):
    r = results["packed"][family]
    assert r["first_diff"] > 1e-2  # the earlier tokens did change
    assert r["last_diff"] <= 1e-6, r


def test_torch_dist_saved_at_tp2_loads_at_tp1(results):
    r = results["ckpt"]
    assert r["loaded_vs_hf_import"] <= 1e-6
    assert r["roundtrip"]["exact_all_ranks"]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_engine_logprobs_equal_the_actors_after_a_stream_from_tp2_ep2(results, family):
    r = results["engine"][family]
    assert r["n_tokens"] >= 12
    assert r["logprob_max_abs_diff"] < 1e-4, r
