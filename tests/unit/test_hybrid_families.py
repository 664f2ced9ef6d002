"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE in the family registry (megarl.models.hybrid), their HF layouts
(megarl.models.hybrid_bridge) against transformers' own splitting of the fused projections, and
the config rules for gated delta-net layers (megarl.config.validate)."""

import types

import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from megarl.config import ConfigError, load_config, validate_model
from megarl.models import UnsupportedModelError, arch_spec
from megarl.models.bridge import ParamMap, merge_shards, read_shard
from tests.distributed.scripts_hybrid import tiny_config


def test_arch_specs():
    nxt, dense, moe = (arch_spec(tiny_config(f)) for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe"))
    for s in (nxt, dense, moe):
        assert s.gdn.linear_layers == (0, 1, 2) and s.num_layers == 4  # every 4th layer full attention
        assert (s.gdn.num_key_heads, s.gdn.num_value_heads, s.gdn.key_head_dim, s.gdn.value_head_dim) == (2, 4, 8, 12)
        assert s.rotary_percent == 0.25 and s.attention_output_gate and s.zero_centered_norm and s.qk_layernorm
    assert nxt.gdn.hf_layout == "qwen3_next" and nxt.vision is None and nxt.hf_prefix == "model."
    assert nxt.num_experts == 4 and nxt.shared_expert_ffn_hidden_size == 48 and nxt.shared_expert_gated
    assert dense.gdn.hf_layout == "qwen3_5" and dense.num_experts == 0 and dense.ffn_hidden_size == 96
    assert dense.mrope_section == (2, 1, 1) and dense.vision.deepstack_visual_indexes == ()
    assert moe.num_experts == 4 and moe.norm_topk_prob and moe.hf_prefix == "model.language_model."


def test_refusals():
    cfg = tiny_config("qwen3_5")
    cfg.text_config.rope_parameters = dict(cfg.text_config.rope_parameters, mrope_section=[2, 2, 2])
    with pytest.raises(UnsupportedModelError, match=r"mrope_section=\[2, 2, 2\].*rotated head_dim/2 = 4"):
        arch_spec(cfg)
    nxt = tiny_config("qwen3_next")
    nxt.mlp_only_layers = [1]
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        arch_spec(nxt)
    nxt = tiny_config("qwen3_next")
    nxt.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        arch_spec(nxt)


def test_context_parallelism_is_refused_at_load_naming_the_field():
    hf = tiny_config("qwen3_next")
    validate_model(load_config(None, ["parallel.tp=2", "model.sequence_parallel=true"]), hf)
    with pytest.raises(ConfigError, match=r"parallel\.cp.*gated delta-net layers.*set parallel.cp=1"):
        validate_model(load_config(None, ["parallel.cp=2"]), hf)
    with pytest.raises(ConfigError, match=r"parallel\.tp.*linear_num_key_heads=2"):
        validate_model(load_config(None, ["parallel.tp=4", "model.sequence_parallel=true"]), hf)


class _Reader:
    """The SliceReader of megarl.models.bridge over in-memory HF tensors (HFCheckpoint's semantics)."""

    def __init__(self, tensors):
        self.t = tensors

    def shape(self, name):
        return tuple(self.t[name].shape)

    def read(self, name, dim=None, start=0, stop=0):
        x = self.t[name]
        return x if dim is None else x[start:stop] if dim == 0 else x[:, start:stop]


def _shards(pm, tensors, spec, tp, local_rows):
    return [read_shard(pm, _Reader(tensors), spec, (local_rows, 64), r, tp) for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_next_fused_projections_split_as_transformers_splits_them(tp):
    """in_proj_qkvz / in_proj_ba (grouped by key head) -> megatron's in_proj shard of TP rank t:
    [q; k; v; z; b; a] of that rank's heads, where q..a are what transformers'
    `fix_query_key_value_ordering` makes of the same projections; merged back, bit-exact."""
    spec = arch_spec(tiny_config("qwen3_next"))
    gdn, gen = spec.gdn, torch.Generator().manual_seed(0)
    r = gdn.num_value_heads // gdn.num_key_heads
    qkvz = torch.randn(gdn.num_key_heads * (2 * gdn.key_head_dim + 2 * r * gdn.value_head_dim), 64, generator=gen)
    ba = torch.randn(gdn.num_key_heads * 2 * r, 64, generator=gen)
    names = ("l.in_proj_qkvz.weight", "l.in_proj_ba.weight")
    pm = ParamMap("decoder.layers.0.self_attention.in_proj.weight", names, "gdn_in_proj_grouped")
    shards = _shards(pm, dict(zip(names, (qkvz, ba))), spec, tp, gdn.in_proj_dim // tp)
    layer = types.SimpleNamespace(num_k_heads=gdn.num_key_heads, num_v_heads=gdn.num_value_heads,
                                  head_k_dim=gdn.key_head_dim, head_v_dim=gdn.value_head_dim)
    eye = torch.eye(64)[None]  # x = I: the projections' outputs are the weights' rows
    q, k, v, z, b, a = hf_next.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(layer, eye @ qkvz.T, eye @ ba.T)
    per = gdn.num_key_heads // tp
    for t, shard in enumerate(shards):
        heads = slice(t * per, (t + 1) * per)
        vheads = slice(t * per * r, (t + 1) * per * r)
        expected = [q[0, :, heads].reshape(64, -1), k[0, :, heads].reshape(64, -1), v[0, :, vheads].reshape(64, -1),
                    z[0, :, vheads].reshape(64, -1), b[0, :, vheads], a[0, :, vheads]]
        assert torch.equal(shard, torch.cat(expected, dim=1).T)
    merged = merge_shards(pm, shards, spec)
    assert torch.equal(merged[0], qkvz) and torch.equal(merged[1], ba)


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_attention_q_proj_splits_as_transformers_splits_it(tp):
    """q_proj rows per head [q_h; gate_h] (transformers: view(..., heads, 2d).chunk(2)) -> megatron's
    linear_qkv per query group [queries; gates; k; v]; merged back, bit-exact."""
    spec = arch_spec(tiny_config("qwen3_next"))
    d, heads, groups = spec.head_dim, spec.num_attention_heads, spec.num_query_groups
    gen = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(rows, 64, generator=gen) for n, rows in
          (("q", 2 * heads * d), ("k", groups * d), ("v", groups * d))}
    pm = ParamMap("decoder.layers.3.self_attention.linear_qkv.weight", ("q", "k", "v"), "qkv_gated")
    shards = _shards(pm, hf, spec, tp, (2 * heads + 2 * groups) * d // tp)
    query, gate = torch.chunk((torch.eye(64) @ hf["q"].T).view(64, heads, 2 * d), 2, dim=-1)
    hpg = heads // groups
    full = torch.cat(shards).view(groups, (2 * hpg + 2) * d, 64)
    for g in range(groups):
        hs = slice(g * hpg, (g + 1) * hpg)
        assert torch.equal(full[g, : hpg * d].T, query[:, hs].reshape(64, -1))
        assert torch.equal(full[g, hpg * d: 2 * hpg * d].T, gate[:, hs].reshape(64, -1))
        assert torch.equal(full[g, 2 * hpg * d: (2 * hpg + 1) * d], hf["k"][g * d:(g + 1) * d])
    assert all(torch.equal(x, hf[n]) for x, n in zip(merge_shards(pm, shards, spec), "qkv"))


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_projections_and_conv_channels(tp):
    """in_proj_qkv / z / b / a and conv1d's q | k | v channels -> each TP rank's heads; merged back."""
    spec = arch_spec(tiny_config("qwen3_5"))
    gdn, gen = spec.gdn, torch.Generator().manual_seed(2)
    hf = {"qkv": torch.randn(gdn.conv_dim, 64, generator=gen), "z": torch.randn(gdn.value_dim, 64, generator=gen),
          "b": torch.randn(gdn.num_value_heads, 64, generator=gen), "a": torch.randn(gdn.num_value_heads, 64, generator=gen)}
    pm = ParamMap("x.in_proj.weight", ("qkv", "z", "b", "a"), "gdn_in_proj")
    shards = _shards(pm, hf, spec, tp, gdn.in_proj_dim // tp)
    qd, vd, nv = gdn.key_dim // tp, gdn.value_dim // tp, gdn.num_value_heads // tp
    for t, shard in enumerate(shards):
        q, k, v, z, b, a = shard.split([qd, qd, vd, vd, nv, nv])
        assert torch.equal(q, hf["qkv"][t * qd:(t + 1) * qd]) and torch.equal(k, hf["qkv"][gdn.key_dim + t * qd:][:qd])
        assert torch.equal(v, hf["qkv"][2 * gdn.key_dim + t * vd:][:vd]) and torch.equal(z, hf["z"][t * vd:(t + 1) * vd])
        assert torch.equal(b, hf["b"][t * nv:(t + 1) * nv]) and torch.equal(a, hf["a"][t * nv:(t + 1) * nv])
    merged = merge_shards(pm, shards, spec)
    assert all(torch.equal(m, hf[n]) for m, n in zip(merged, ("qkv", "z", "b", "a")))
    conv = {"c": torch.randn(gdn.conv_dim, 1, 4, generator=gen)}
    cpm = ParamMap("x.conv1d.weight", ("c",), "gdn_conv")
    cshards = [read_shard(cpm, _Reader(conv), spec, (gdn.conv_dim // tp, 1, 4), t, tp) for t in range(tp)]
    assert torch.equal(cshards[-1][:qd], conv["c"][(tp - 1) * qd:tp * qd])
    assert torch.equal(merge_shards(cpm, cshards, spec)[0], conv["c"])


def test_mtp_tensors_are_skipped():
    from megarl.models.deepseek import mtp_names

    cfg = tiny_config("qwen3_next")
    cfg.mtp_num_hidden_layers = 1
    spec = arch_spec(cfg)
    assert mtp_names({"mtp.fc.weight", "mtp.layers.0.input_layernorm.weight", "model.norm.weight"}, spec) == {
        "mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"}
    assert transformers.__version__.startswith("5.")


def test_the_quickstart_tiny_qwen3_5_moe(tmp_path):
    # configs/quickstart/qwen3_5_moe.yaml: megarl's tiny Qwen3.5-MoE is a hybrid the registry accepts
    # (two delta-net layers, then gated attention with a quarter of each head rotated), and a run dir
    # built for it refuses the Qwen3-VL-MoE quickstart (and back)
    from pathlib import Path

    from megarl.quickstart import _check_built_model, save_quickstart_model

    quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart"
    hybrid, vlm_moe = (load_config(str(quickstart / f"{n}.yaml")) for n in ("qwen3_5_moe", "vlm_moe"))
    save_quickstart_model(tmp_path / "hybrid", hybrid)
    save_quickstart_model(tmp_path / "vlm_moe", vlm_moe)
    spec = arch_spec(transformers.AutoConfig.from_pretrained(tmp_path / "hybrid"))
    assert spec.model_type == "qwen3_5_moe" and spec.num_layers == 3 and spec.gdn.linear_layers == (0, 1)
    assert (spec.gdn.num_key_heads, spec.gdn.num_value_heads, spec.gdn.key_head_dim) == (2, 4, 32)
    assert spec.rotary_percent == 0.25 and spec.mrope_section == (2, 1, 1) and spec.vision.deepstack_visual_indexes == ()
    assert spec.num_experts == 4 and spec.shared_expert_ffn_hidden_size == 192 and spec.shared_expert_gated
    _check_built_model(tmp_path / "hybrid", hybrid)
    with pytest.raises(SystemExit, match="holds a tiny qwen3_5_moe model"):
        _check_built_model(tmp_path / "hybrid", vlm_moe)
    with pytest.raises(SystemExit, match="holds a tiny qwen3_vl_moe model"):
        _check_built_model(tmp_path / "vlm_moe", hybrid)
