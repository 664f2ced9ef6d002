"""Qwen3-VL-MoE on megatron-core vs HF transformers' own model: images + text logits and text-only
logits at TP1, TP2, PP2, EP2, TP2xEP2, PP2xEP2; bit-exact HF -> Megatron -> HF weight stream at each
layout (fused expert tensors reassembled over EP); gradients at TP1 (also with full activation
recompute) and TP2 with sequence parallelism;
the build-time error when DeepStack would span pipeline stages. One 4-rank gloo launch in strict device
mode (tests/distributed/scripts_vlm_moe.py) feeds those tests; the conversion CLI (hf-to-megatron EP2
-> megatron-to-hf PP2 -> verify with images at TP2xEP2) runs on its own."""

from tests.distributed.launch import CPU_ONLY, convert_roundtrip, worker_fixture

pytestmark = CPU_ONLY
LAYOUTS = ("tp1_pp1_ep1", "tp2_pp1_ep1", "tp1_pp2_ep1", "tp1_pp1_ep2", "tp2_pp1_ep2", "tp1_pp2_ep2")
# vision: patch embed 2 + position table + 12 per block x 3 + (norm 2 + 4 linear) x (merger + 2 DeepStack);
# LM: embed, norm, lm_head + per layer 4 attention + 2 q/k norms + 2 norms + router + 2 fused experts
N_KEYS = 3 + 36 + 18 + 3 + 4 * 11
results = worker_fixture("scripts_vlm_moe.py", 4)


def test_inputs_have_varied_images(results):
    # 4 images of different sizes, both smaller and larger than the 6 x 6 learned position grid
    grids = {tuple(g) for g in results["grids"]}
    assert len(grids) == 4
    assert min(h for _, h, _ in grids) < 6 < max(h for _, h, _ in grids)
    assert results["n_image_tokens"] == sum(t * h * w // 4 for t, h, w in results["grids"])
    assert results["hf_layout"]  # HF reads the released [E, H, 2I] expert layout back exactly


def test_comparisons_have_teeth(results):
    # HF's own logits move by far more than the tolerance without DeepStack, with Qwen2.5-VL's
    # contiguous M-RoPE sections instead of the interleaved ones, and without the position table
    for variant in ("no_deepstack", "contiguous_mrope", "no_position_table"):
        assert results["teeth"][variant] > 1e-2, variant


def test_megatron_logits_equal_hf_at_every_layout(results):
    assert results["ref_std"] > 0.5
    for layout in LAYOUTS:
        r = results["logits"][layout]
        assert r["shape"] == results["seq"] + [160], layout  # vocab padding stripped
        assert r["max_abs_diff"] < 1e-4, (layout, r)


def test_text_only_packed_logits_equal_hf(results):
    for layout in LAYOUTS:
        assert results["text_only"][layout] < 1e-4, layout


def test_sequence_parallel_logits_equal_hf(results):
    assert results["sp"] < 1e-4


def test_hf_megatron_hf_roundtrip_is_bit_exact(results):
    for layout in LAYOUTS:
        r = results["roundtrip"][layout]
        assert r["exact_all_ranks"], (layout, r)
        assert r["keys"] == N_KEYS
        assert r["buckets"] > 1


def test_gradients_equal_hf(results):
    # every HF tensor (DeepStack mergers and fused experts included) has a gradient within 1e-4
    for layout in ("tp1_pp1_ep1", "tp1_pp1_ep1_recompute", "tp2_pp1_ep1_sp"):
        r = results["grads"][layout]
        assert not r["missing"] and r["n"] == N_KEYS and r["visual"] == 57
        assert r["max_rel"] < 1e-4, (layout, r)


def test_deepstack_beyond_first_pipeline_stage_fails_at_build(results):
    msg = results["pp_error"]
    assert "deepstack_visual_indexes" in msg and "pipeline" in msg and "holds only 2 layer" in msg


def test_convert_cli_roundtrip_and_verify_with_images(tmp_path):
    from tests.distributed.scripts_vlm_moe import make_tiny_vlm_moe

    # bit-exact tensors back, verify's logit diff < 1e-4 (convert_roundtrip checks both)
    out = convert_roundtrip(make_tiny_vlm_moe(tmp_path / "hf", seed=5), tmp_path, ["--ep", 2], ["--pp", 2],
                            ["--tp", 2, "--ep", 2, "--batch", 3, "--seq", 10], timeout=600)
    assert "images=" in out["verify"]
