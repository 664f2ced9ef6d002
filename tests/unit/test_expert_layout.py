"""Fused expert tensors in either on-disk layout (megarl.weights.expert_layout, HFCheckpoint): how a
checkpoint's layout is decided, reading a transformers-5 file as the released layout, and what
transformers 5.19's own save_pretrained writes for every MoE family megarl reads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megarl.weights import CheckpointError, HFCheckpoint
from megarl.weights.expert_layout import (
    RELEASED, TRANSFORMERS5, ExpertLayoutError, fused_expert_layout, version_layout)

GU, DN = "model.language_model.layers.{}.mlp.experts.gate_up_proj", "model.language_model.layers.{}.mlp.experts.down_proj"


def shapes(layout: str, hidden: int, ffn: int, layers: int = 2, experts: int = 4) -> dict:
    gate_up, down = ((hidden, 2 * ffn), (ffn, hidden)) if layout == RELEASED else ((2 * ffn, hidden), (hidden, ffn))
    out = {}
    for i in range(layers):
        out[GU.format(i)], out[DN.format(i)] = (experts, *gate_up), (experts, *down)
    return out


@pytest.mark.parametrize("hidden,ffn", [(64, 24), (64, 32), (32, 32), (48, 96)])  # (64, 32): H = 2I
@pytest.mark.parametrize("layout", [RELEASED, TRANSFORMERS5])
def test_pairs_decide_every_size_even_where_gate_up_is_ambiguous(layout, hidden, ffn):
    wrong = {"transformers_version": "4.57.0" if layout == TRANSFORMERS5 else "5.19.0"}  # a misleading version
    assert fused_expert_layout(shapes(layout, hidden, ffn), wrong) == layout


def test_lone_tensors_use_the_config_then_the_version():
    cfg = {"text_config": {"hidden_size": 64, "moe_intermediate_size": 24}}
    only_gate_up = {k: v for k, v in shapes(TRANSFORMERS5, 64, 24).items() if k.endswith("gate_up_proj")}
    assert fused_expert_layout(only_gate_up, cfg) == TRANSFORMERS5
    ambiguous = {k: v for k, v in shapes(RELEASED, 64, 32).items() if k.endswith("gate_up_proj")}  # H = 2I
    amb_cfg = {"text_config": {"hidden_size": 64, "moe_intermediate_size": 32}}
    assert fused_expert_layout(ambiguous, {**amb_cfg, "transformers_version": "5.19.0"}) == TRANSFORMERS5
    assert fused_expert_layout(ambiguous, {**amb_cfg, "transformers_version": "4.57.0.dev0"}) == RELEASED
    assert fused_expert_layout(ambiguous, amb_cfg) == RELEASED  # no version: the released layout
    assert version_layout({"transformers_version": "5.0.0rc1"}) == TRANSFORMERS5
    assert fused_expert_layout({"model.layers.0.mlp.gate.weight": (4, 8)}) is None


def test_layers_in_two_layouts_are_refused():
    mixed = {**shapes(RELEASED, 64, 24, layers=1), **{k.replace("layers.0", "layers.1"): v
                                                     for k, v in shapes(TRANSFORMERS5, 64, 24, layers=1).items()}}
    with pytest.raises(ExpertLayoutError, match="layers.0.*released.*layers.1.*transformers >= 5"):
        fused_expert_layout(mixed)


def test_checkpoint_reads_transformers5_file_as_released(tmp_path):
    gen = torch.Generator().manual_seed(0)
    released = {GU.format(0): torch.randn(4, 64, 48, generator=gen), DN.format(0): torch.randn(4, 24, 64, generator=gen),
                "model.language_model.norm.weight": torch.randn(64, generator=gen)}
    stored = {k: (v.transpose(1, 2).contiguous() if v.dim() == 3 else v) for k, v in released.items()}
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "transformers_version": "5.19.0"}))
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.expert_layout == TRANSFORMERS5
    for name, want in released.items():
        assert ckpt.shape(name) == tuple(want.shape)
        assert torch.equal(ckpt.read(name), want)
    assert torch.equal(ckpt.read(GU.format(0), 0, 1, 3), released[GU.format(0)][1:3])  # experts 1, 2
    assert torch.equal(ckpt.read(DN.format(0), 1, 8, 16), released[DN.format(0)][:, 8:16])
    # a file whose layers disagree names two of them
    stored[DN.format(1)], stored[GU.format(1)] = released[DN.format(0)], released[GU.format(0)]
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="two layouts"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_other_moe_families_save_per_expert_tensors(tmp_path, family):
    """transformers 5.19 holds every Qwen MoE's experts fused in memory ([E, 2I, H]), but its
    save_pretrained writes qwen3_moe / qwen2_moe back as one tensor per expert (the names megarl
    reads); only qwen3_vl_moe comes back fused and transposed. If that changed, this fails."""
    cls = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[family]
    config = cls[0](vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                    shared_expert_intermediate_size=16)
    model = cls[1](config)
    assert tuple(model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 32, 32)  # fused in memory
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert tuple(saved["model.layers.0.mlp.experts.3.gate_proj.weight"].shape) == (16, 32)
    assert not [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert HFCheckpoint(tmp_path).expert_layout is None
