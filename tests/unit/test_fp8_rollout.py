"""FP8 rollout weights (rollout.weights_dtype=fp8, megarl.weights.fp8_blocks): which tensors the stream
quantizes, the round trip quantize -> engine -> dequantize within block-FP8 rounding of the trainer's
weights, the builtin engine taking them, SGLang's engine folder and no double quantization, the
config field and the planner's engine bytes."""

import json

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.weights.fp8_blocks import (
    FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX, dequantize, dequantized_stream, quantizable, quantize, quantized_stream)

QWEN3_MOE_NAMES = {
    "model.layers.0.self_attn.q_proj.weight": True, "model.layers.0.self_attn.o_proj.weight": True,
    "model.layers.0.self_attn.q_norm.weight": False, "model.layers.0.input_layernorm.weight": False,
    "model.layers.0.mlp.gate.weight": False,  # the router stays in bf16 (SGLang builds it unquantized)
    "model.layers.0.mlp.experts.3.gate_proj.weight": True, "model.layers.0.mlp.experts.3.down_proj.weight": True,
    "model.layers.1.mlp.shared_expert.up_proj.weight": True, "model.layers.1.mlp.shared_expert_gate.weight": False,
    "model.layers.0.self_attn.q_proj.bias": False, "model.embed_tokens.weight": False, "lm_head.weight": False,
    "model.norm.weight": False, "model.visual.blocks.0.mlp.gate_proj.weight": False,
    "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": True, "model.layers.2.mlp.gate.e_score_correction_bias": False,
}


def test_the_linear_weights_of_attention_and_mlp_are_quantized_and_nothing_else():
    for name, picked in QWEN3_MOE_NAMES.items():
        t = torch.ones(4, 4) if name.endswith(".weight") else torch.ones(4)
        assert quantizable(name, t) is picked, name
    assert not quantizable("model.layers.0.self_attn.q_proj.weight", torch.ones(4, 4, dtype=torch.float8_e4m3fn))


def test_round_trip_is_within_block_fp8_rounding_and_the_rest_passes_bit_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-2, 1, 200)  # partial edge blocks, wide range
    norm = torch.rand(200, generator=g)
    bucket = [("model.layers.0.mlp.down_proj.weight", w), ("model.layers.0.input_layernorm.weight", norm)]
    (sent,) = quantized_stream([bucket])
    assert [n for n, _ in sent] == [bucket[0][0], bucket[0][0] + SCALE_SUFFIX, bucket[1][0]]
    q, s = sent[0][1], sent[1][1]
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    assert q.numel() + 4 * s.numel() < w.numel() * 2 // 1.9  # about half of bf16's bytes
    (back,) = dequantized_stream([sent])
    assert [n for n, _ in back] == [bucket[0][0], bucket[1][0]]
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    err = (back[0][1] - w).abs()
    assert (err <= w.abs() / 16 + full * 2 ** -9).all()  # e4m3: 3 mantissa bits; subnormals near 0
    assert err.max() > 0 and torch.equal(back[1][1], norm)
    with pytest.raises(ValueError, match="without its"):
        list(dequantized_stream([[sent[0]]]))  # a quantized weight needs its scale in the same bucket


def test_the_builtin_engine_takes_fp8_weights_dequantized(tmp_path):
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64))
    engine = BuiltinEngine.from_pretrained(tmp_path / "m")
    from safetensors.torch import load_file

    files = load_file(tmp_path / "m" / "model.safetensors")
    buckets = [list(files.items())]
    engine.update_weights(quantized_stream(buckets))
    state = engine.model.state_dict()
    quantized = [n for n, t in files.items() if quantizable(n, t)]
    assert quantized and len(quantized) < len(files)
    for name, t in files.items():
        got = state[name]
        if name in quantized:
            assert torch.equal(got, dequantize(*quantize(t)).to(got.dtype)), name
        else:
            assert torch.equal(got, t.to(got.dtype)), name


def test_sglang_engine_folder_declares_block_fp8_and_the_engine_does_not_quantize_twice(tmp_path):
    from megarl.rollout.sglang.weights import fp8_engine_checkpoint, fp8_names, quantized
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64))
    out = fp8_engine_checkpoint(tmp_path / "m", tmp_path / "engine")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    assert fp8_names(out) == (set(), (128, 128))
    w = torch.randn(8, 8)
    (sent,) = quantized_stream([[("model.layers.0.mlp.up_proj.weight", w)]])
    (again,) = quantized(iter([sent]), {"model.layers.0.mlp.up_proj.weight"}, (128, 128))
    assert [(n, t.dtype) for n, t in again] == [(n, t.dtype) for n, t in sent]  # passed, not quantized again


def test_config_field_and_planner_bytes():
    with pytest.raises(ConfigError, match="rollout.weights_dtype"):
        load_config(None, ["rollout.weights_dtype=int4"])
    from megarl.planner import GPUS, load_arch, plan

    one_node = ["parallel.rollout_tp=8", "rollout.sglang_dp_size=1", "rollout.sglang_ep_size=1",
                "rollout.sglang_server_args={}"]  # engines of one node: the weights leave little room for KV
    cfg = load_config(["configs/recipes/qwen3-235b-a22b/dapo.yaml", "configs/layouts/qwen3-235b-a22b/16node.yaml"],
                      one_node)
    arch, hf, _ = load_arch(cfg)
    bf16 = plan(cfg, arch, hf, GPUS["h100"])
    cfg.rollout.weights_dtype = "fp8"
    fp8 = plan(cfg, arch, hf, GPUS["h100"])
    assert fp8.engine_weights == pytest.approx(bf16.engine_weights / 2, rel=0.05)  # 1 byte, + scales, embeddings 2
    assert fp8.kv_tokens > 1.5 * bf16.kv_tokens and fp8.time["rollout_s"] < bf16.time["rollout_s"]
