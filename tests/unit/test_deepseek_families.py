"""DeepSeek-V3 / Kimi-K2 / GLM-4.5 without ranks: the ArchSpec and what it refuses, the HF naming
tables against transformers' own checkpoints, YaRN against transformers, and the builtin engine
(multi-latent attention over a latent cache, partial RoPE, sigmoid routing with the selection
bias) against HF log-probs and HF's experts."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.models import arch_spec
from megarl.models.bridge import expected_hf_shapes
from megarl.models.families import UnsupportedModelError
from megarl.models.yarn import attention_factor, softmax_mscale, yarn_inv_freq, yarn_settings
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.torch_model import kv_cache_bytes, model_args_from_hf_config
from megarl.rollout.types import SamplingParams
from tests.distributed.scripts_deepseek import FAMILIES, YARN, make_tiny, tiny_config

PROMPTS = [[5, 9, 14, 3], [7, 7, 120, 33, 2, 64, 18, 1, 1, 9], [100, 4]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {fam: make_tiny(fam, root / fam, seed=i) for i, fam in enumerate(FAMILIES)}


def test_arch_spec_reads_routing_attention_and_mtp():
    ds = arch_spec(tiny_config("deepseek_v3"))
    assert (ds.moe_score_function, ds.moe_expert_bias, ds.moe_num_groups, ds.moe_group_topk) == ("sigmoid", True, 4, 2)
    assert (ds.moe_scaling_factor, ds.moe_first_dense, ds.shared_expert_gated) == (2.5, 1, False)
    assert ds.mla.q_lora_rank == 40 and ds.mla.q_head_dim == 20 and ds.head_dim == 20 and ds.mla.yarn.factor == 4.0
    assert ds.shared_expert_ffn_hidden_size == 32 and ds.mtp_layers == 1 and ds.num_query_groups == 4
    noq = arch_spec(tiny_config("deepseek_v3_noq"))
    assert noq.mla.q_lora_rank == 0 and noq.mla.yarn is None and noq.moe_num_groups == 0
    assert noq.shared_expert_ffn_hidden_size == 64  # 2 shared experts
    glm = arch_spec(tiny_config("glm4_moe"))
    assert glm.mla is None and glm.rotary_percent == 0.5 and glm.head_dim == 24 and glm.num_query_groups == 2
    assert glm.add_qkv_bias and glm.qk_layernorm and glm.moe_num_groups == 2 and glm.moe_group_topk == 1


@pytest.mark.parametrize("change,match", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(n_group=4, topk_group=1), "scores a group by its top-"),  # top-4 of 1 group: HF's top-2 differs
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_scaling={**YARN, "attention_factor": 1.2}), "attention_factor"),
])
def test_what_megatron_would_compute_differently_is_refused(change, match):
    cfg = tiny_config("deepseek_v3")
    for k, v in change.items():
        setattr(cfg, k, v)
    if "rope_scaling" in change:
        cfg = transformers.DeepseekV3Config(**{**cfg.to_dict(), "rope_scaling": change["rope_scaling"]})
    with pytest.raises(UnsupportedModelError, match=match):
        arch_spec(cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_expected_shapes_are_the_checkpoint_transformers_writes(models, family):
    """Every tensor HF saves (per-expert names, the fp32 bias, the dense first layer) and only those."""
    saved = load_file(models[family] / "model.safetensors")
    assert expected_hf_shapes(arch_spec(tiny_config(family))) == {k: tuple(v.shape) for k, v in saved.items()}
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_yarn_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config("deepseek_v3")
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    s = yarn_settings(cfg.rope_parameters, cfg.max_position_embeddings)
    assert torch.equal(yarn_inv_freq(cfg.rope_parameters["rope_theta"], cfg.qk_rope_head_dim, s), hf_freq)
    assert attention_factor(s) == hf_factor
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(20 ** -0.5 * softmax_mscale(s), rel=1e-12)
    assert softmax_mscale(s) == pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    # mscale_all_dim unset: HF ignores mscale, so does megarl (megatron's factor then equals HF's)
    lone = yarn_settings({**cfg.rope_parameters, "mscale": 3.0, "mscale_all_dim": None}, 64)
    assert lone.mscale == 1.0 and softmax_mscale(lone) == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_engine_equals_hf_logprobs_and_routes_like_hf(models, family):
    """Sampling through the engine's KV cache (prefill + decode), then HF's log-probs of the same
    tokens; the engine's recorded experts per MoE layer are HF's top-k for every prompt token."""
    path = models[family]
    engine = BuiltinEngine.from_pretrained(path, tokenizer=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    samples = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7))
    worst, tokens = 0.0, 0
    for s in samples:
        seen = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
                 for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float(), -1)
        for h in hooks:
            h.remove()
        n = len(s.prompt_ids)
        ref = logp[n - 1:n - 1 + len(s.response_ids)].gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        worst, tokens = max(worst, float((ref - torch.tensor(s.logprobs)).abs().max())), tokens + len(s.response_ids)
        routed = s.routed_experts.long()  # [tokens, layers, k], every layer
        assert routed.shape[1] == 4 and torch.equal(routed[:, 0], torch.arange(routed.shape[2]).expand(len(routed), -1))
        for layer, experts in seen.items():  # every forwarded token (all but the last)
            assert torch.equal(routed[:-1, layer], experts[:-1].sort(-1).values), (family, layer)
    assert tokens >= 40 and worst < 1e-4, worst


def test_latent_cache_is_the_compressed_latent(models):
    args = model_args_from_hf_config(json.loads((models["deepseek_v3"] / "config.json").read_text()))
    # 4 layers x 3 rows x 10 slots x (kv_lora_rank 24 + rope 8) x 4 bytes: no expanded K / V
    assert kv_cache_bytes(args, 3, 10, torch.float32) == 4 * 3 * 10 * 32 * 4
    glm = model_args_from_hf_config(json.loads((models["glm4_moe"] / "config.json").read_text()))
    assert kv_cache_bytes(glm, 3, 10, torch.float32) == 4 * 2 * 3 * 10 * 2 * 24 * 4


def test_engine_keeps_the_selection_bias_in_float32(models):
    engine = BuiltinEngine.from_pretrained(models["deepseek_v3"], tokenizer=None, dtype=torch.bfloat16)
    saved = load_file(models["deepseek_v3"] / "model.safetensors")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    params = dict(engine.model.named_parameters())
    assert params[name].dtype == torch.float32 and torch.equal(params[name], saved[name])
    assert params["model.layers.2.mlp.gate.weight"].dtype == torch.bfloat16
    engine.release_memory(discard_weights=True)
    engine.resume_memory()
    assert dict(engine.model.named_parameters())[name].dtype == torch.float32


def test_engine_skips_the_multi_token_prediction_layer(models, tmp_path):
    from tests.distributed.scripts_deepseek import with_mtp_layer

    with_mtp_layer(models["deepseek_v3"], tmp_path / "mtp", tiny_config("deepseek_v3"))
    plain = BuiltinEngine.from_pretrained(models["deepseek_v3"], tokenizer=None)
    with_mtp = BuiltinEngine.from_pretrained(tmp_path / "mtp", tokenizer=None)  # layer 4's tensors: skipped
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    assert [s.logprobs for s in with_mtp.generate(PROMPTS, sampling)] == [s.logprobs for s in plain.generate(PROMPTS, sampling)]
