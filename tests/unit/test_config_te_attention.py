"""Attention settings that Transformer Engine refuses for megarl's packed (THD) rows are refused
at load, naming the field and the reason: parallel context exchange types other than p2p / a2a,
a2a where TE 2.11 asserts (multi-latent attention; heads per TP rank that CP does not divide), and
attention backends that leave TE's attention with no kernel."""

from __future__ import annotations

import glob
import json
import os

import pytest

from megarl.config import ConfigError, load_config, validate_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


@pytest.mark.parametrize("value, reason", [
    ("allgather", "'all_gather'.*Unsupported communication type.*refuses THD"),
    ("a2a+p2p", "hierarchical CP refuses THD.*hierarchical_context_parallel_sizes"),
])
@pytest.mark.parametrize("impl", ["transformer_engine", "auto", "local"])
def test_cp_comm_types_te_rejects_for_packed_rows_are_refused(value, reason, impl):
    with pytest.raises(ConfigError, match=rf"model\.cp_comm_type.*{reason}.*\['p2p', 'a2a'\]"):
        load_config(None, [f"model.cp_comm_type={value}", "parallel.cp=2", f"model.transformer_impl={impl}"])


@pytest.mark.parametrize("value", ["p2p", "a2a"])
def test_p2p_and_a2a_load(value):
    assert load_config(None, [f"model.cp_comm_type={value}", "parallel.cp=2",
                              "model.transformer_impl=transformer_engine"]).model.cp_comm_type == value


@pytest.mark.parametrize("impl", ["transformer_engine", "auto"])
def test_local_attention_backend_is_refused_with_te_layers(impl):
    with pytest.raises(ConfigError, match=r"model\.attention_backend.*NVTE_UNFUSED_ATTN to 0.*No dot product "
                                          r"attention backend is available.*transformer_impl=local"):
        load_config(None, ["model.attention_backend=local", f"model.transformer_impl={impl}"])


def test_local_attention_backend_loads_with_local_layers():
    cfg = load_config(None, ["model.attention_backend=local", "model.transformer_impl=local", "parallel.cp=2"])
    assert cfg.model.attention_backend == "local"


def test_unfused_attention_backend_is_refused_under_te_context_parallelism():
    with pytest.raises(ConfigError, match=r"model\.attention_backend.*'unfused'.*parallel\.cp=2"):
        load_config(None, ["model.attention_backend=unfused", "model.transformer_impl=transformer_engine", "parallel.cp=2"])
    load_config(None, ["model.attention_backend=unfused", "model.transformer_impl=transformer_engine"])  # cp = 1
    load_config(None, ["model.attention_backend=unfused", "model.transformer_impl=local", "parallel.cp=2"])


def test_no_shipped_config_uses_a_refused_setting():
    """Every recipe composed with every layout of its model loads (and so passes the checks above)."""
    for layout in glob.glob(os.path.join(CONFIGS, "layouts", "*", "*.yaml")):
        model = os.path.basename(os.path.dirname(layout))
        for recipe in glob.glob(os.path.join(CONFIGS, "recipes", model, "*.yaml")):
            m = load_config([recipe, layout]).model
            assert m.cp_comm_type in ("p2p", "a2a") and m.attention_backend != "local"


def _model(name: str) -> dict:
    with open(os.path.join(CONFIGS, "models", f"{name}.json")) as f:
        return json.load(f)


def _layout(*overrides: str):
    return load_config(None, ["parallel.nodes=64", "parallel.ep=1", *overrides])


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
@pytest.mark.parametrize("impl", ["transformer_engine", "auto"])
def test_a2a_is_refused_for_multi_latent_attention(model, impl):
    """TE 2.11 asserts 'Context parallelism does not support MLA' for a2a (keys of 192, values of 128);
    both models have 128 / 64 heads, which CP=2 at TP=8 divides: the MLA rule alone refuses."""
    cfg = _layout("model.cp_comm_type=a2a", "parallel.cp=2", "parallel.tp=8", "model.sequence_parallel=true",
                  f"model.transformer_impl={impl}")
    with pytest.raises(ConfigError, match=r"model\.cp_comm_type.*'a2a' with multi-latent attention.*= 192.*"
                                          r"v_head_dim = 128.*use p2p"):
        validate_model(cfg, _model(model))


@pytest.mark.parametrize("overrides", [
    ["model.cp_comm_type=p2p", "parallel.cp=2"],  # TE's MLA path
    ["model.cp_comm_type=a2a", "parallel.cp=1"],  # no context parallelism: TE never exchanges
    ["model.cp_comm_type=a2a", "parallel.cp=2", "model.transformer_impl=local"],  # megarl's attention all-gathers
])
def test_multi_latent_attention_loads_where_te_runs_it(overrides):
    validate_model(_layout("parallel.tp=8", "model.sequence_parallel=true", *overrides), _model("deepseek-v3"))


@pytest.mark.parametrize("model, tp, cp, q_rank, kv_rank", [
    ("qwen2.5-7b", 4, 2, 7, 1), ("qwen2.5-7b", 2, 4, 14, 2), ("qwen2.5-7b", 1, 8, 28, 4),
    ("qwen3-30b-a3b", 1, 8, 32, 4),  # the query heads divide, the key/value heads do not
])
def test_a2a_is_refused_when_cp_does_not_divide_each_tp_ranks_heads(model, tp, cp, q_rank, kv_rank):
    """Qwen2.5-7B: 28 query heads, 4 key/value heads; Qwen3-30B-A3B: 32 and 4. TE's a2a asserts 'The
    number of attention heads needs to be divisible by CP size' on each TP rank's query and key/value heads."""
    cfg = _layout("model.cp_comm_type=a2a", f"parallel.cp={cp}", f"parallel.tp={tp}",
                  "model.transformer_impl=transformer_engine")
    with pytest.raises(ConfigError, match=rf"model\.cp_comm_type.*leave {q_rank} query and {kv_rank} key/value "
                                          rf"heads per TP rank, not both divisible by parallel\.cp={cp}"):
        validate_model(cfg, _model(model))


@pytest.mark.parametrize("tp, cp", [(2, 2), (1, 4), (1, 2)])
def test_a2a_loads_when_cp_divides_each_tp_ranks_heads(tp, cp):
    validate_model(_layout("model.cp_comm_type=a2a", f"parallel.cp={cp}", f"parallel.tp={tp}",
                           "model.transformer_impl=transformer_engine"), _model("qwen2.5-7b"))
