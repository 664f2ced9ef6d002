"""DeepSeek-V3 / Kimi-K2 (multi-latent attention) and GLM-4.5 HF <-> Megatron on 4 gloo ranks, one launch
(tests/distributed/scripts_deepseek.py): `megarl convert verify --packed --grad` at TP2, EP2, PP2
and TP2xEP2, bit-exact HF -> Megatron -> HF streams (the selection bias included, float32 in a
bf16 stream), HF's experts, torch_dist saved at EP2 loaded at EP1, multi-token-prediction layers
skipped, and a TP2xEP2 stream into the builtin engine; plus the conversion CLI end to end."""

import pytest
import torch

from tests.distributed.launch import convert_roundtrip, last_value, run_worker
from tests.distributed.scripts_deepseek import FAMILIES, LAYOUTS, NOQ_VERIFY

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo test")
LAYOUT_NAMES = [f"tp{tp}_pp{pp}_ep{ep}" for tp, pp, ep in LAYOUTS]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek")


@pytest.fixture(scope="module")
def results(work):
    return run_worker("scripts_deepseek.py", 4, work, timeout=1500)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_logits_and_gradients_at_every_layout(results, family):
    layouts = LAYOUT_NAMES if family != "deepseek_v3_noq" else [f"tp{t}_pp{p}_ep{e}" for t, p, e in NOQ_VERIFY]
    assert set(results["verify"][family]) == set(layouts)
    for layout in layouts:
        r = results["verify"][family][layout]
        assert r["rc"] == 0, (family, layout, r)
        assert r["max_abs_logit_diff"] < 1e-4 and r["max_rel_grad_diff"] < 1e-4, (family, layout, r)
        assert r["max_rel_grad_diff"] > 0  # gradients were compared (not an empty set)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_is_bit_exact_at_every_layout(results, family):
    for layout in LAYOUT_NAMES:
        r = results["roundtrip"][family][layout]
        assert r["exact_all_ranks"], (family, layout, r)
        assert r["buckets"] > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_hf_and_the_selection_bias_matters(results, family):
    r = results["routing"][family]
    assert r["agree"] == 1.0  # every token of the first MoE layer picks HF's experts
    assert r["moved_by_bias"] > 0.2  # without the bias, HF itself would pick other experts
    assert r["experts_used"] >= 4  # the tokens spread over the experts (routing is not trivial)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bias_stays_float32_in_a_bf16_stream(results, family):
    r = results["bf16_stream"][family]
    assert r["biases"] == 3 and r["float32"] and r["exact"] and r["weights_bf16"]


def test_torch_dist_saved_at_ep2_loads_at_ep1(results):
    r = results["ckpt"]
    assert r["saved_vs_hf"] < 1e-4 and r["loaded_vs_hf"] < 1e-4
    assert r["roundtrip"]["exact_all_ranks"]  # the expert_bias buffers were saved and loaded


def test_multi_token_prediction_layers_are_skipped_and_said_so(results):
    r = results["mtp"]
    assert r["mtp_layers"] == 1 and r["vs_hf"] < 1e-4 and r["added"] > 40
    assert f"skipping {r['added']} tensors of 1 multi-token-prediction layer(s)" in r["log"], r["log"]


def test_block_fp8_checkpoint_imports_dequantized_at_tp2_ep2(results):
    r = results["fp8"]
    assert r["quantized"] > 100 and r["same_names"] and r["exact"]
    assert r["source_claims_fp8"] and not r["export_claims_fp8"]  # exported in the stream's dtype


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_engine_logprobs_equal_actor_after_stream_from_tp2_ep2(results, family):
    r = results["engine"][family]
    assert r["n_sampled_tokens"] >= 12
    assert r["logprob_max_abs_diff"] < 1e-4
    assert r["engine_vs_hf_logits"] < 1e-4
    assert r["biases_streamed"] == r["biases_changed"] == 3  # the perturbed biases reached the engine


def test_convert_cli_deepseek_v3(results, work, tmp_path):
    """hf-to-megatron at TP2xEP2 -> megatron-to-hf at EP1 bit-exact -> verify at TP2xEP2 (4 ranks; the
    gradients at every layout: test_verify_logits_and_gradients_at_every_layout)."""
    out = convert_roundtrip(work / "deepseek_v3", tmp_path, ["--tp", 2, "--ep", 2], [], ["--tp", 2, "--ep", 2])
    assert "ep=2" in out["hf-to-megatron"]
    assert last_value(out["verify"]) < 1e-4
