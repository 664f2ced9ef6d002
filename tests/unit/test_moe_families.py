"""MoE families in one process: HF config -> ArchSpec -> megatron MoE fields, the builtin engine's
MoE block against transformers' own, config validation and the conversion tool's world size."""

import argparse

import pytest
import torch
import transformers

from megarl.config import ConfigError, load_config, validate_model
from megarl.models.families import UnsupportedModelError, arch_spec
from tests.distributed.scripts_moe import make_tiny_moe, tiny_moe_config


def test_arch_spec_of_moe_families():
    q3 = arch_spec(tiny_moe_config("qwen3_moe"))
    assert (q3.num_experts, q3.moe_topk, q3.moe_ffn_hidden_size, q3.norm_topk_prob) == (6, 2, 32, True)
    assert q3.shared_expert_ffn_hidden_size == 0 and q3.qk_layernorm and not q3.add_qkv_bias
    q2 = arch_spec(tiny_moe_config("qwen2_moe"))
    assert (q2.num_experts, q2.norm_topk_prob, q2.shared_expert_ffn_hidden_size) == (6, False, 48)
    assert q2.add_qkv_bias and not q2.qk_layernorm
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        arch_spec(tiny_moe_config("qwen3_moe", mlp_only_layers=[1]))


def test_megatron_routing_fields_follow_norm_topk_prob():
    from megarl.models.builder import moe_config_fields

    q3 = moe_config_fields(arch_spec(tiny_moe_config("qwen3_moe")))
    q2 = moe_config_fields(arch_spec(tiny_moe_config("qwen2_moe")))
    # renormalised top-k == softmax over the top-k logits (post-softmax routing)
    assert q3["moe_router_pre_softmax"] is False and q3["moe_shared_expert_intermediate_size"] is None
    assert q2["moe_router_pre_softmax"] is True and q2["moe_shared_expert_gate"] is True
    assert q2["moe_shared_expert_intermediate_size"] == 48
    for f in (q2, q3):
        assert f["moe_router_dtype"] == "fp32" and f["moe_aux_loss_coeff"] == 0.0 and f["moe_router_topk"] == 2


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_builtin_engine_moe_block_equals_hf(tmp_path, family):
    from megarl.rollout.builtin import BuiltinEngine

    hf_dir = make_tiny_moe(family, tmp_path / family, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0))
    ours, theirs = engine.model.model.layers[1].mlp, hf.model.layers[1].mlp
    ours.routing_log = log = []
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max()
    assert diff < 1e-5, diff
    _, _, hf_experts = theirs.gate(x.view(-1, 64))
    assert torch.equal(log[0], hf_experts.sort(dim=1).values)
    assert log[0].unique().numel() >= 4  # routing spreads over the experts


def test_validate_model_moe_rules():
    moe = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96,
           "num_experts": 6}
    validate_model(load_config(None, ["parallel.ep=2"]), moe)
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by ep=4"):
        validate_model(load_config(None, ["parallel.ep=4"]), moe)
    with pytest.raises(ConfigError, match="model.sequence_parallel.*trains only with sequence parallelism"):
        validate_model(load_config(None, ["parallel.tp=2"]), moe)


def test_convert_tool_world_size_with_experts():
    from megarl.convert.cli import world_size

    def ns(tp=1, pp=1, cp=1, ep=1, etp=None):
        return argparse.Namespace(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)

    assert world_size(ns(ep=2)) == 2  # experts split over 2 data-parallel ranks
    assert world_size(ns(tp=2, ep=2)) == 4  # expert-TP 2 x EP 2
    assert world_size(ns(tp=2, ep=2, etp=1)) == 2  # EP inside the TP group's ranks
    assert world_size(ns(pp=2, ep=2)) == 4
    assert world_size(ns(tp=2, pp=2, cp=2)) == 8  # dense: tp*pp*cp
