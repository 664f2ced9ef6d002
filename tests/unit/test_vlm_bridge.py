"""Qwen2.5-VL vision-tower weight layouts (megarl.models.vision.bridge through megarl.models.bridge):
TP shards read from HF tensors merge back bit-exactly at TP 1, 2, 4, and the fused qkv shard of a
rank holds its heads as megatron's [q_h; k_h; v_h] groups."""

from __future__ import annotations

import pytest
import torch

from megarl.models.bridge import ParamMap, expected_hf_shapes, hf_shapes, map_param, merge_shards, read_shard
from megarl.models.families import arch_spec
from tests.distributed.scripts_vlm_common import tiny_vlm_config
from tests.unit.test_models_bridge import DictReader


def spec4():
    cfg = tiny_vlm_config()
    cfg.vision_config.num_heads = 4  # head_dim 8: TP up to 4
    return arch_spec(cfg)


MEGATRON_NAMES = [f"vision_model.blocks.1.{s}" for s in (
    "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")] + [
    "vision_model.patch_embed.proj.weight", "vision_model.merger.ln_q.weight",
    "vision_model.merger.mlp.encoder.linear_fc1.weight", "vision_model.merger.mlp.encoder.linear_fc1.bias",
    "vision_model.merger.mlp.encoder.linear_fc2.weight", "vision_model.merger.mlp.encoder.linear_fc2.bias"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vision_shards_merge_back_bit_exactly(tp):
    spec = spec4()
    shapes = expected_hf_shapes(spec)
    gen = torch.Generator().manual_seed(tp)
    tensors = {n: torch.randn(s, generator=gen) for n, s in shapes.items() if n.startswith("visual.")}
    assert len(tensors) == 1 + 2 * 12 + 5
    reader, covered = DictReader(tensors), set()
    for name in MEGATRON_NAMES:
        pm = map_param(name, None, spec)
        shards = []
        for r in range(tp):
            full_shapes = [tensors[n].shape for n in pm.hf_names]
            local = read_shard(pm, reader, spec, _local_shape(pm, full_shapes, tp), r, tp)
            assert [tuple(s) for s in hf_shapes(pm, tuple(local.shape), spec, tp)] == [tuple(s) for s in full_shapes]
            shards.append(local)
        merged = merge_shards(pm, shards, spec)
        for n, t in zip(pm.hf_names, merged):
            assert torch.equal(t, tensors[n]), (name, n, tp)
            covered.add(n)
    assert covered == {n for n in tensors if not n.startswith("visual.blocks.0.")}  # every kind of tensor


def _local_shape(pm: ParamMap, full_shapes, tp: int) -> tuple[int, ...]:
    s = tuple(full_shapes[0])
    if pm.layout in ("replicated",):
        return s
    if pm.layout == "row":
        return (s[0], s[1] // tp)
    if pm.layout == "fc1":
        return (2 * s[0] // tp, *s[1:])
    return (s[0] // tp, *s[1:])  # col, fused_qkv


def test_fused_qkv_shard_is_megatron_per_head_layout():
    spec, tp, d = spec4(), 2, 8
    c = 32
    q, k, v = (torch.randn(4 * d, c) for _ in range(3))
    reader = DictReader({"visual.blocks.0.attn.qkv.weight": torch.cat([q, k, v])})
    pm = map_param("vision_model.blocks.0.self_attention.linear_qkv.weight", None, spec)
    shard = read_shard(pm, reader, spec, (3 * 2 * d, c), 1, tp)  # rank 1: heads 2, 3
    want = torch.cat([torch.cat([q[h * d:(h + 1) * d], k[h * d:(h + 1) * d], v[h * d:(h + 1) * d]]) for h in (2, 3)])
    assert torch.equal(shard, want)
    with pytest.raises(ValueError, match="not divisible"):
        read_shard(pm, reader, spec, (3 * d * 4 // 3, c), 0, 3)
