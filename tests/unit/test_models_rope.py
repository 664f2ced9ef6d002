"""RoPE settings of HF configs of any layout vs HF transformers' own rotary embedding modules.

transformers 5.x moved `rope_theta` / `rope_scaling` into `config.rope_parameters`; the
reference for every case is the `inv_freq` (and cos/sin) of the installed transformers' rotary
embedding built from the same config, never a value megarl computed.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from megarl.models.families import UnsupportedModelError, arch_spec
from megarl.models.rope import default_inv_freq, hf_inv_freq, rope_params
from megarl.rollout.torch_model import DecoderLM, model_args_from_hf_config, rope_cos_sin, rope_inv_freq

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
ROTARY = {"qwen2": Qwen2RotaryEmbedding, "qwen3": Qwen3RotaryEmbedding, "llama": LlamaRotaryEmbedding}
CONFIGS = {
    "qwen2.5_theta_1e6": lambda: transformers.Qwen2Config(**SIZES, rope_theta=1e6),
    "qwen3_theta_1e6": lambda: transformers.Qwen3Config(**SIZES, head_dim=32, rope_theta=1e6),
    "llama3.1_scaling": lambda: transformers.LlamaConfig(
        **SIZES, rope_theta=5e5, rope_scaling=dict(LLAMA31_ROPE), max_position_embeddings=131072),
    "llama3_small_window": lambda: transformers.LlamaConfig(
        **SIZES, rope_theta=100.0, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 2.0, "original_max_position_embeddings": 16}),
    "llama_linear": lambda: transformers.LlamaConfig(
        **SIZES, rope_theta=2e4, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama_defaults": lambda: transformers.LlamaConfig(**SIZES),
}


def _hf_rotary(config) -> torch.nn.Module:
    return ROTARY[config.model_type](config)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.fixture(params=list(CONFIGS))
def config(request):
    return CONFIGS[request.param]()


def test_hf_inv_freq_matches_hf_rotary_embedding(config):
    expected = _hf_rotary(config).inv_freq
    torch.testing.assert_close(hf_inv_freq(config, _head_dim(config)), expected, rtol=0, atol=0)


def test_arch_spec_rope_theta_gives_hf_base_frequencies(config):
    """`build_model` passes ArchSpec.rope_theta to megatron as `rotary_base`."""
    shape = {"head_dim": config.head_dim} if config.model_type == "qwen3" else {}
    unscaled = type(config)(**SIZES, **shape, rope_parameters={
        "rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]})
    torch.testing.assert_close(default_inv_freq(arch_spec(config).rope_theta, _head_dim(config)),
                               _hf_rotary(unscaled).inv_freq, rtol=0, atol=0)


def test_builtin_engine_rope_matches_hf_from_config_object_and_saved_json(config, tmp_path):
    expected = _hf_rotary(config).inv_freq
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for source in (config, config.to_dict(), saved):
        args = model_args_from_hf_config(source)
        inv_freq, scale = rope_inv_freq(args)
        torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
        assert scale == _hf_rotary(config).attention_scaling
        torch.testing.assert_close(DecoderLM(args).inv_freq, expected, rtol=0, atol=0)


def test_builtin_engine_cos_sin_match_hf_rotary_forward(config):
    rotary = _hf_rotary(config)
    positions = torch.tensor([[0, 1, 2, 7, 100, 5000], [3, 3, 9, 40, 64, 65]])
    x = torch.zeros(2, 6, _head_dim(config))
    hf_cos, hf_sin = rotary(x, positions)
    inv_freq, scale = rope_inv_freq(model_args_from_hf_config(config))
    cos, sin = rope_cos_sin(positions, inv_freq, scale, x.dtype)
    torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin, rtol=0, atol=0)


LEGACY_JSON = {  # transformers 4.x config.json layout: top-level rope_theta + rope_scaling
    "qwen2_theta_1e6": {"model_type": "qwen2", **SIZES, "rope_theta": 1e6, "rope_scaling": None},
    "llama3_legacy": {"model_type": "llama", **SIZES, "rope_theta": 5e5, "max_position_embeddings": 131072,
                      "rope_scaling": dict(LLAMA31_ROPE)},
    "linear_legacy_type_key": {"model_type": "llama", **SIZES, "rope_theta": 3e4,
                               "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3_no_original_length": {"model_type": "llama", **SIZES, "rope_theta": 5e5,
                                  "max_position_embeddings": 4096,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "no_rope_fields": {"model_type": "qwen3", **SIZES, "head_dim": 32},
    "theta_only_in_rope_parameters": {"model_type": "llama", **SIZES,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 7e5}},
}


@pytest.mark.parametrize("name", list(LEGACY_JSON))
def test_config_json_layouts_match_hf_loading_them(name):
    """HF's own loader of the same config.json dict is the reference (it standardises old layouts)."""
    raw = LEGACY_JSON[name]
    hf_config = transformers.AutoConfig.for_model(**json.loads(json.dumps(raw)))
    expected = _hf_rotary(hf_config).inv_freq
    head_dim = _head_dim(hf_config)
    args = model_args_from_hf_config(json.loads(json.dumps(raw)))
    torch.testing.assert_close(rope_inv_freq(args)[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(hf_inv_freq(json.loads(json.dumps(raw)), head_dim), expected, rtol=0, atol=0)
    torch.testing.assert_close(hf_inv_freq(hf_config, head_dim), expected, rtol=0, atol=0)
    assert arch_spec(hf_config).rope_theta == hf_config.rope_parameters["rope_theta"]


def test_transformers_4_config_object_layout():
    """A 4.x-style config object (attributes rope_theta / rope_scaling, no rope_parameters)."""
    legacy = SimpleNamespace(model_type="llama", rope_theta=5e5, rope_scaling=dict(LLAMA31_ROPE),
                             max_position_embeddings=131072, **SIZES)
    hf_config = transformers.LlamaConfig(**SIZES, rope_theta=5e5, rope_scaling=dict(LLAMA31_ROPE),
                                         max_position_embeddings=131072)
    torch.testing.assert_close(hf_inv_freq(legacy, 16), _hf_rotary(hf_config).inv_freq, rtol=0, atol=0)
    assert rope_params(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == (1e6, None)


def test_per_layer_type_rope_parameters_are_rejected():
    nested = {"model_type": "llama", **SIZES,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    with pytest.raises(ValueError, match="per-layer-type"):
        rope_params(nested)


@pytest.mark.parametrize("make", [
    lambda: transformers.Qwen2Config(**SIZES, partial_rotary_factor=0.5),
    lambda: transformers.LlamaConfig(**SIZES, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
])
def test_partial_rotary_factor_is_rejected_in_either_place(make):
    config = make()
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        arch_spec(config)


def test_unsupported_rope_type_is_rejected_by_both_paths():
    config = transformers.Qwen2Config(**SIZES, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                 "rope_theta": 1e6})
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn'"):
        arch_spec(config)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported by the builtin engine"):
        DecoderLM(model_args_from_hf_config(config.to_dict()))
