"""Qwen3-VL-MoE family facts and weight layouts (megarl.models.vision.qwen3_vl_spec / qwen3_vl_bridge
through megarl.models.bridge): the HF tensor set and shapes equal what HF saves (expert tensors in the
released [E, H, 2I] / [E, I, H] layout); fused expert shards hold HF's gate / up / down of the right
expert and merge back bit-exactly over expert-TP and EP; vision shards merge back at TP 1, 2, 4."""

from __future__ import annotations

import pytest
import torch
import transformers

from megarl.models.bridge import ParamMap, expected_hf_shapes, hf_shapes, merge_shards, read_shard
from megarl.models.families import UnsupportedModelError, arch_spec
from megarl.models.vision.qwen3_vl_bridge import map_qwen3_vision_param
from tests.distributed.scripts_vlm_moe import tiny_vlm_moe_config
from tests.unit.test_models_bridge import DictReader


def test_spec_reads_hf_config():
    spec = arch_spec(tiny_vlm_moe_config())
    assert spec.model_type == "qwen3_vl_moe" and spec.num_experts == 6 and spec.moe_topk == 2
    assert spec.norm_topk_prob  # HF's router always renormalises; the config has no such field
    assert spec.qk_layernorm and spec.head_dim == 32 and spec.mrope_section == (6, 5, 5)
    assert spec.hf_prefix == "model.language_model." and spec.hf_fused_experts
    assert spec.vision.deepstack_visual_indexes == (0, 1) and spec.vision.position_grid_side == 6


@pytest.mark.parametrize("change,what", [
    (lambda c: setattr(c.vision_config, "hidden_act", "quick_gelu"), "hidden_act"),
    (lambda c: c.text_config.rope_parameters.update(mrope_section=[4, 4, 4]), "mrope_section"),
    (lambda c: setattr(c.vision_config, "deepstack_visual_indexes", [0, 3]), "deepstack_visual_indexes"),
])
def test_unsupported_configs_fail_with_the_setting_named(change, what):
    cfg = tiny_vlm_moe_config()
    change(cfg)
    with pytest.raises(UnsupportedModelError, match=what):
        arch_spec(cfg)


def test_expected_shapes_equal_what_hf_saves():
    cfg = tiny_vlm_moe_config()
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    hf = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for n in [n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, a, b = hf[n]
        hf[n] = (e, b, a)  # the released checkpoints' layout (HF transposes it on load)
    assert expected_hf_shapes(arch_spec(cfg)) == hf


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)])
def test_fused_experts_shard_and_merge_back(ep, etp):
    spec = arch_spec(tiny_vlm_moe_config())
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_ffn_hidden_size
    gen = torch.Generator().manual_seed(ep * 10 + etp)
    names = {"experts_gate_up": "model.language_model.layers.2.mlp.experts.gate_up_proj",
             "experts_down": "model.language_model.layers.2.mlp.experts.down_proj"}
    files = {names["experts_gate_up"]: torch.randn(e, h, 2 * i, generator=gen),
             names["experts_down"]: torch.randn(e, i, h, generator=gen)}
    reader, local = DictReader(files), e // ep
    for layout, name in names.items():
        parts = []
        for rank in range(ep):
            shards = []
            for r in range(etp):
                slots = []
                for slot in range(local):
                    g = rank * local + slot
                    pm = ParamMap(f"decoder.layers.2.mlp.experts.local_experts.{slot}.x", (name,), layout,
                                  expert=slot, hf_expert=g)
                    shape = (2 * i // etp, h) if layout == "experts_gate_up" else (h, i // etp)
                    shard = read_shard(pm, reader, spec, shape, r, etp)
                    assert tuple(shard.shape) == shape
                    assert hf_shapes(pm, shape, spec, etp) == [tuple(files[name].shape)]
                    hf_g = files[name][g].t()  # HF's in-memory expert g: [gate; up] [2I, H] or down [H, I]
                    if layout == "experts_gate_up":  # megatron fc1 = [gate rows of rank r; up rows of rank r]
                        rows = slice(r * i // etp, (r + 1) * i // etp)
                        assert torch.equal(shard, torch.cat([hf_g[:i][rows], hf_g[i:][rows]]))
                    else:  # fc2 = down columns of rank r
                        assert torch.equal(shard, hf_g[:, r * i // etp: (r + 1) * i // etp])
                    slots.append(shard)
                shards.append(torch.stack(slots))
            parts.append(merge_shards(pm, shards, spec)[0])
        assert torch.equal(torch.cat(parts), files[name])


VISION_NAMES = [f"vision_model.blocks.2.{s}" for s in (
    "input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")] + [
    "vision_model.patch_embed.proj.weight", "vision_model.patch_embed.proj.bias", "vision_model.pos_embed.weight"] + [
    f"vision_model.{m}.{s}" for m in ("merger", "deepstack_merger_list.0", "deepstack_merger_list.1") for s in (
        "norm.weight", "norm.bias", "mlp.encoder.linear_fc1.weight", "mlp.encoder.linear_fc1.bias",
        "mlp.encoder.linear_fc2.weight", "mlp.encoder.linear_fc2.bias")]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vision_shards_merge_back_bit_exactly(tp):
    cfg = tiny_vlm_moe_config()
    cfg.vision_config.num_heads = 4  # head_dim 8: TP up to 4
    spec = arch_spec(cfg)
    gen = torch.Generator().manual_seed(tp)
    tensors = {n: torch.randn(s, generator=gen) for n, s in expected_hf_shapes(spec).items() if n.startswith(
        "model.visual.") and (n.startswith("model.visual.blocks.2.") or not n.startswith("model.visual.blocks."))}
    reader, covered = DictReader(tensors), set()
    for name in VISION_NAMES:
        pm = map_qwen3_vision_param(name, ParamMap)
        covered.update(pm.hf_names)
        full = tensors[pm.hf_names[0]]
        if pm.layout == "replicated":
            shards = [read_shard(pm, reader, spec, tuple(full.shape), r, tp) for r in range(tp)]
        else:
            local = (full.shape[0] // tp, *full.shape[1:]) if pm.layout in ("col", "fused_qkv") else \
                (full.shape[0], full.shape[1] // tp)
            shards = [read_shard(pm, reader, spec, local, r, tp) for r in range(tp)]
            assert hf_shapes(pm, local, spec, tp) == [tuple(full.shape)]
        assert torch.equal(merge_shards(pm, shards, spec)[0], full), name
    assert covered == set(tensors)  # every HF vision tensor of a block and of the mergers is mapped
    qkv = map_qwen3_vision_param("vision_model.blocks.2.self_attention.linear_qkv.weight", ParamMap)
    if tp == 2:  # rank 1 holds heads 2, 3 as megatron's [q_h; k_h; v_h] groups of head_dim 8 rows
        shard = read_shard(qkv, reader, spec, (24, 32), 1, 2)
        full = tensors[qkv.hf_names[0]]
        assert torch.equal(shard[:8], full[16:24]) and torch.equal(shard[8:16], full[48:56])
