"""The quickstart's tiny MoE models (megarl/tasks/tiny_model.py) and its `quickstart.*` config."""

from pathlib import Path

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.models.families import arch_spec
from megarl.quickstart import tiny_model_spec
from megarl.tasks.tiny_model import TinyModelSpec, build_byte_tokenizer, save_tiny_model, tiny_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart"
# hidden 128, 3 layers, 4 heads of 32 (2 KV heads), vocab 259 tokens -> 320 rows, 8 experts of 192
ATTENTION = 2 * 128 * 128 + 2 * 128 * 64
EXPERTS = 8 * 3 * 128 * 192
ROUTER, NORMS, EMBEDDINGS = 8 * 128, 2 * 128, 2 * 320 * 128 + 128


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_saves_loads_and_has_the_hand_counted_parameters(tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelSpec(family=family, num_experts=8, moe_topk=2, moe_intermediate=192, seed=5)
    save_tiny_model(tmp_path / "m", spec)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    c = model.config
    assert c.model_type == family and (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 192)
    assert c.decoder_sparse_step == 1 and not c.mlp_only_layers and c.vocab_size == 320
    if family == "qwen3_moe":  # q/k norms (2 x head_dim 32), top-2 probabilities renormalised
        per_layer = ATTENTION + 2 * 32 + NORMS + ROUTER + EXPERTS
        assert c.norm_topk_prob and c.head_dim == 32
    else:  # q/k/v bias, a shared expert of 192 with its sigmoid gate (h -> 1), no renormalisation
        per_layer = ATTENTION + (128 + 64 + 64) + NORMS + ROUTER + EXPERTS + 3 * 128 * 192 + 128
        assert not c.norm_topk_prob and c.shared_expert_intermediate_size == 192
    assert sum(p.numel() for p in model.parameters()) == 3 * per_layer + EMBEDDINGS
    s = "Q: 12+5=?\n2+5+0=7"
    assert tok.decode(tok(s)["input_ids"]) == s and tok.eos_token_id == 256
    out = model(input_ids=torch.tensor([tok(s)["input_ids"]])).logits
    assert out.shape == (1, len(s), 320) and torch.isfinite(out).all()
    # megarl's bridge reads the same architecture
    arch = arch_spec(c)
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == (8, 2, 192)
    assert arch.shared_expert_ffn_hidden_size == (192 if family == "qwen2_moe" else 0)


def test_a_token_of_the_moe_costs_the_dense_mlp():
    # 2 experts of 192 per token = the dense model's one 384-wide MLP
    dense, moe = TinyModelSpec(), tiny_model_spec(load_config(str(QUICKSTART / "moe.yaml")))
    assert (moe.family, moe.num_experts, moe.moe_topk) == ("qwen3_moe", 8, 2)
    assert moe.moe_topk * moe.moe_intermediate == dense.intermediate == 384
    assert (moe.layers, moe.hidden, moe.heads) == (dense.layers, dense.hidden, dense.heads)


def test_quickstart_defaults_to_the_dense_model():
    spec = tiny_model_spec(load_config(str(QUICKSTART / "dapo.yaml")))
    assert spec.family == "qwen2" and spec.num_experts == spec.moe_topk == spec.moe_intermediate == 0
    assert tiny_config(build_byte_tokenizer(), spec).model_type == "qwen2"


@pytest.mark.parametrize("override, field", [("quickstart.num_experts=1", "quickstart.num_experts"),
                                             ("quickstart.moe_topk=9", "quickstart.moe_topk"),
                                             ("quickstart.moe_intermediate=0", "quickstart.moe_intermediate"),
                                             ("quickstart.family=mixtral", "quickstart.family")])
def test_bad_quickstart_settings_fail_at_load_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(str(QUICKSTART / "moe.yaml"), [override])


def test_a_run_dir_keeps_its_model_family(tmp_path):
    from megarl.quickstart import _check_built_model

    moe, dense = load_config(str(QUICKSTART / "moe.yaml")), load_config(str(QUICKSTART / "dapo.yaml"))
    save_tiny_model(tmp_path / "moe", tiny_model_spec(moe))
    save_tiny_model(tmp_path / "dense", tiny_model_spec(dense))
    _check_built_model(tmp_path / "moe", moe)
    _check_built_model(tmp_path / "dense", dense)
    with pytest.raises(SystemExit, match="quickstart.* asks for .*qwen3_moe"):
        _check_built_model(tmp_path / "dense", moe)  # the MoE config on a dense run dir
    with pytest.raises(SystemExit, match="'num_experts': 4"):
        _check_built_model(tmp_path / "moe", load_config(str(QUICKSTART / "moe.yaml"), ["quickstart.num_experts=4"]))
