"""Pure parts of megarl.models: vocab padding, RoPE frequencies, family registry, TP layouts."""

import dataclasses
import math

import pytest
import torch
import transformers

from megarl.models.bridge import ParamMap, expected_hf_shapes, hf_shapes, merge_shards, read_shard
from megarl.models.builder import padded_vocab_size
from megarl.models.families import UnsupportedModelError, arch_spec, supported_model_types
from megarl.models.rope import hf_inv_freq, llama3_inv_freq


class DictReader:
    """The HF checkpoint reader's interface over a dict of tensors: a tensor's shape, and a copy
    of the whole tensor or of its [start, stop) slice along `dim`."""

    def __init__(self, tensors):
        self.t = tensors

    def shape(self, name):
        return tuple(self.t[name].shape)

    def read(self, name, dim=None, start=0, stop=0):
        t = self.t[name]
        return t.clone() if dim is None else t.narrow(dim, start, stop - start).clone()


def small_spec(**kw):
    cfg = transformers.Qwen2Config(vocab_size=5, hidden_size=8, intermediate_size=4, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, **kw)
    return dataclasses.replace(arch_spec(cfg), head_dim=1)


def test_padded_vocab_size():
    assert padded_vocab_size(150, 1) == 256
    assert padded_vocab_size(150, 2) == 256
    assert padded_vocab_size(150, 4) == 512
    assert padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(151936, 8) == 152576  # Qwen2.5 at TP=8
    assert padded_vocab_size(10, 2, divisible_by=4) == 16


def test_qkv_layout_by_hand():
    # heads=4, groups=2, d=1: q=[0,1,2,3], k=[10,11], v=[20,21] (one column)
    spec = small_spec()
    col = lambda *v: torch.tensor(v, dtype=torch.float32)[:, None]  # noqa: E731
    r = DictReader({"q": col(0, 1, 2, 3), "k": col(10, 11), "v": col(20, 21)})
    pm = ParamMap("linear_qkv.weight", ("q", "k", "v"), "qkv")
    full = read_shard(pm, r, spec, (8, 1), 0, 1)
    assert full[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q q k v] per query group
    rank1 = read_shard(pm, r, spec, (4, 1), 1, 2)
    assert rank1[:, 0].tolist() == [2, 3, 11, 21]
    shards = [read_shard(pm, r, spec, (4, 1), i, 2) for i in range(2)]
    q, k, v = merge_shards(pm, shards, spec)
    assert q[:, 0].tolist() == [0, 1, 2, 3] and k[:, 0].tolist() == [10, 11] and v[:, 0].tolist() == [20, 21]
    assert hf_shapes(pm, (4, 1), spec, 2) == [(4, 1), (2, 1), (2, 1)]


def test_fc1_vocab_and_row_layouts_by_hand():
    spec = small_spec()
    col = lambda *v: torch.tensor(v, dtype=torch.float32)[:, None]  # noqa: E731
    r = DictReader({"gate": col(0, 1, 2, 3), "up": col(10, 11, 12, 13),
                    "emb": col(1, 2, 3, 4, 5), "o": torch.arange(8.0).reshape(2, 4)})
    fc1 = ParamMap("fc1", ("gate", "up"), "fc1")
    assert read_shard(fc1, r, spec, (4, 1), 0, 2)[:, 0].tolist() == [0, 1, 10, 11]
    assert read_shard(fc1, r, spec, (4, 1), 1, 2)[:, 0].tolist() == [2, 3, 12, 13]
    gate, up = merge_shards(fc1, [read_shard(fc1, r, spec, (4, 1), i, 2) for i in range(2)], spec)
    assert gate[:, 0].tolist() == [0, 1, 2, 3] and up[:, 0].tolist() == [10, 11, 12, 13]
    # vocab 5 padded to 8 at tp=2: rank 1 owns rows 4..7 = [5, pad, pad, pad]
    emb = ParamMap("emb", ("emb",), "vocab")
    assert read_shard(emb, r, spec, (4, 1), 1, 2)[:, 0].tolist() == [5, 0, 0, 0]
    shards = [read_shard(emb, r, spec, (4, 1), i, 2) for i in range(2)]
    assert merge_shards(emb, shards, spec)[0][:, 0].tolist() == [1, 2, 3, 4, 5]  # padding cut
    row = ParamMap("o", ("o",), "row")
    assert read_shard(row, r, spec, (2, 2), 1, 2).tolist() == [[2, 3], [6, 7]]
    assert torch.equal(merge_shards(row, [read_shard(row, r, spec, (2, 2), i, 2) for i in range(2)], spec)[0],
                       r.t["o"])


def test_llama3_inv_freq_matches_hf_for_non_default_factors():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=100.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
    ours = hf_inv_freq(cfg, 16)
    theirs, attn_factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert attn_factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # all three regimes occur, so the test covers low, medium and high frequencies
    base = hf_inv_freq(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=100.0), 16)
    wavelen = 2 * math.pi / base
    assert (wavelen < 8).any() and ((wavelen >= 8) & (wavelen <= 16)).any() and (wavelen > 16).any()
    assert not torch.allclose(ours, base)


def test_llama3_inv_freq_matches_megatron_for_its_fixed_factors():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    ours = llama3_inv_freq(base, 8.0, 1.0, 4.0, 8192)
    mega = RotaryEmbedding._apply_scaling(None, base.clone(), factor=8.0)
    torch.testing.assert_close(ours, mega, rtol=0, atol=0)
    # ... and megatron's hard-coded factors give different frequencies for other configs
    assert not torch.allclose(llama3_inv_freq(base, 8.0, 1.0, 2.0, 1024), mega)


def test_family_registry_and_specs():
    assert {"qwen2", "qwen3", "llama"} <= set(supported_model_types())
    q3 = arch_spec(transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24))
    assert q3.head_dim == 24 and q3.qk_layernorm and not q3.add_qkv_bias
    q2 = arch_spec(transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4))
    assert q2.add_qkv_bias and q2.head_dim == 16 and not q2.qk_layernorm
    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2'.*\['deepseek_v3', 'glm4_moe', 'kimi_k2', 'llama', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'"):
        arch_spec(transformers.GPT2Config())
    with pytest.raises(UnsupportedModelError, match="sliding"):
        arch_spec(transformers.Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn'"):
        arch_spec(transformers.Qwen2Config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        arch_spec(transformers.LlamaConfig(attention_bias=True))


@pytest.mark.parametrize("cfg", [
    transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    transformers.Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=12),
    transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
], ids=["qwen2", "qwen3", "llama_tied"])
def test_expected_hf_shapes_match_transformers(cfg):
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight")  # HF's save_pretrained drops the tied copy too
    assert expected_hf_shapes(arch_spec(cfg)) == hf
