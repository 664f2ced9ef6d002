"""The planner on DeepSeek-V3 / Kimi-K2 (multi-latent attention) and GLM-4.5: parameters against HF
models and hand counts, dense first layers and routed experts per stage, the latent KV cache, the
MLA activation terms and the FP8 engine weights."""

import json
import os

import pytest

import megarl.planner as plan
from megarl.config import load_config
from megarl.planner.mla import MLAShape

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def hf_json(name: str) -> dict:
    with open(os.path.join(CONFIGS, "models", f"{name}.json")) as f:
        return json.load(f)


DSV3 = plan.Arch.from_hf(hf_json("deepseek-v3"))
GLM = plan.Arch.from_hf(hf_json("glm-4.5"))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_noq", "glm4_moe"])
def test_param_count_matches_hf_model(family):
    torch = pytest.importorskip("torch")
    from tests.distributed.scripts_deepseek import tiny_config

    cfg = tiny_config(family)
    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf = {**cfg.to_dict(), "model_type": cfg.model_type}
    arch = plan.Arch.from_hf(hf)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert arch.total_params() == sum(p.numel() for p in model.parameters()) + biases
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert arch.moe_layers * arch.expert_layer_params() == experts == 3 * 8 * 3 * 64 * 32
    k = cfg.num_experts_per_tok
    assert arch.active_params() == arch.total_params() - experts * (8 - k) // 8


def test_deepseek_v3_sizes_by_hand():
    h, H, E = 7168, 128, 256
    attention = 1536 * H * 192 + 512 * H * 256 + H * 128 * h  # q_b, kv_b, o
    replicated = 2 * h + h * 1536 + 1536 + h * 576 + 512  # norms, q_a + norm, kv_a + norm
    dense = attention + replicated + 3 * h * 18432
    moe = attention + replicated + E * h + E + E * 3 * h * 2048 + 3 * h * 2048  # router + bias, experts, shared
    total = 3 * dense + 58 * moe + 2 * 129280 * h + h
    assert DSV3.total_params() == total == 671_026_419_200
    assert DSV3.active_params() == total - 58 * (E - 8) * 3 * h * 2048
    assert (DSV3.dense_layers, DSV3.moe_layers, DSV3.fp8) == (3, 58, True)
    # the latent cache: 61 layers x (512 + 64) x 2 bytes per token, the same on every engine GPU
    assert DSV3.kv_bytes_per_token(8) == DSV3.kv_bytes_per_token(1) == 61 * 576 * 2


def test_stages_count_their_dense_and_moe_layers():
    assert DSV3.stage_layers(1, 0) == (3, 58)
    assert GLM.stage_layers(4, 0) == (3, 20) and GLM.stage_layers(4, 3) == (0, 23)
    # routed experts of the last stage (all MoE) over EP: 23 layers x 160 / 32 experts of 3 h f_e
    assert GLM.stage_expert_params(4, ep=32) == 23 * 160 * 3 * 5120 * 1536 // 32


def test_fp8_engine_holds_one_byte_per_weight():
    bf16 = plan.Arch.from_hf({**hf_json("deepseek-v3"), "quantization_config": None})
    emb = 2 * 129280 * 7168
    assert bf16.engine_weight_bytes(8) == 2 * DSV3.total_params() / 8
    assert DSV3.engine_weight_bytes(8) == pytest.approx(((DSV3.total_params() - emb) * (1 + 4 / 128**2) + 2 * emb) / 8)


def test_mla_activations_replace_the_gqa_terms():
    cfg = load_config(None, ["model.name=deepseek-v3", "parallel.tp=8", "parallel.ep=64", "parallel.etp=1", "parallel.nodes=8",
                             "model.sequence_parallel=true", "model.recompute=selective",
                             "model.transformer_impl=transformer_engine"])
    m = MLAShape(1536, 512, 128, 64, 128)
    latents, attention = m.activation_bytes(128)
    assert (latents, attention) == (4 * 1536 + 4 * 576, 4 * 128 * 192 + 4 * 128 * 128)
    moe = plan.activation_bytes_per_token_layer(DSV3, cfg, 4096)
    dense = plan.activation_bytes_per_token_layer(DSV3, cfg, 4096, moe_layer=False)
    # a dense layer swaps the shared expert's 6 f_s and the MoE terms for the dense MLP's 6 f
    m_bytes = (8 * 256 + (2 * 8 * 7168 + 6 * 8 * 2048) + 2 * 8 * 7168) / 8
    assert moe - dense == pytest.approx((6 * 2048 - 6 * 18432) / 8 + m_bytes)


def test_glm_layouts_fit_h100_with_engines_over_nodes(capsys):
    # GLM-4.5's 355B bf16 weights: 8 H100s per engine are too few (test_plan.py says what helps); the
    # shipped layouts serve it from engines of 32 GPUs, the FP8 checkpoint as well
    for model in ("glm-4.5", "glm-4.5-fp8"):
        recipe = os.path.join(CONFIGS, "recipes", model, "dapo.yaml")
        layout = os.path.join(CONFIGS, "layouts", model, "16node.yaml")
        assert plan.main(["--recipe", recipe, "--layout", layout, "--gpu", "h100"]) == 0
        out = capsys.readouterr().out
        assert "FITS" in out and "rollout_tp=32 (attention dp" in out
