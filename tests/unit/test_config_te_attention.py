"""Attention settings that Transformer Engine refuses for megarl's packed (THD) rows are refused
at load, naming the field and the reason: parallel context exchange types other than p2p / a2a,
and attention backends that leave TE's attention with no kernel."""

from __future__ import annotations

import glob
import os

import pytest

from megarl.config import ConfigError, load_config

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
