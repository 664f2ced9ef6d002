"""megarl.planner on the hybrid families (Qwen3.5, Qwen3-Next; megarl/planner/hybrid.py): parameters
against HF's models built from the shipped configs, the recurrent state by hand (no KV growth:
only the attention layers' K / V grow with the length), its cost in the engine's concurrency, and
the shipped layouts."""

from __future__ import annotations

import json

import pytest

from megarl import planner as plan
from megarl.config import load_config
from tests.unit.test_plan import CONFIGS, hf_json

MODELS = ("qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3.5-397b-a17b-fp8")
Q35 = plan.Arch.from_hf(hf_json("qwen3.5-35b-a3b"))


@pytest.mark.parametrize("name", MODELS)
def test_shipped_configs_load_in_transformers_and_match_the_planner(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = hf_json(name)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(raw)))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    arch = plan.Arch.from_hf(raw)
    total = sum(p.numel() for p in model.parameters())
    # the planner takes each layer's attention part as the mean over the two layer kinds: within a
    # parameter per layer of HF's count
    assert abs(arch.total_params() - total) <= arch.layers, (arch.total_params(), total)
    assert sum(p.numel() for n, p in model.named_parameters() if ".visual." in n) == arch.vision.total_params()
    text = config.text_config
    assert arch.gdn.layers == sum(t == "linear_attention" for t in text.layer_types) == 3 * arch.layers // 4
    assert arch.attention_layers == arch.layers // 4 and arch.fp8 == name.endswith("-fp8")


def test_sizes_of_the_released_models():
    # HF's models built from the shipped config.json files: Qwen3.5-35B-A3B and -397B-A17B by name
    big = plan.Arch.from_hf(hf_json("qwen3.5-397b-a17b"))
    assert round(Q35.total_params() / 1e9, 1) == 35.1 and round(big.total_params() / 1e9, 1) == 396.8
    assert 3.0e9 < Q35.active_params() < 4.0e9 and 17.0e9 < big.active_params() < 18.0e9


def test_recurrent_state_and_kv_by_hand():
    """Per engine GPU at rollout_tp 4: K / V only in the 10 attention layers, 2 x 10 x 1 KV head
    (2 heads < 4 GPUs: replicated) x 256 x 2 bytes per token; the state of one sequence, 30 layers x
    (32 value heads x 128 x 128 float32 + (2 x 16 x 128 + 32 x 128) channels x 3 bf16) / 4."""
    assert Q35.kv_bytes_per_token(4) == 2 * 10 * 1 * 256 * 2 == 10240
    state = 30 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2) / 4
    assert Q35.state_bytes_per_sequence(4) == state == 16_097_280
    assert Q35.state_tokens(4) == pytest.approx(state / 10240)
    dense = plan.Arch.from_hf(hf_json("qwen3-30b-a3b"))
    assert dense.state_bytes_per_sequence(4) == 0 and dense.kv_bytes_per_token(4) == 2 * 48 * 1 * 128 * 2


def test_state_costs_concurrency_not_growth():
    """The engine's concurrent sequences: pool / (tokens + state tokens); the pool per token is the
    attention layers' only (a dense model of the same attention would hold 4x less per byte)."""
    recipe = f"{CONFIGS}/recipes/qwen3.5-35b-a3b/dapo.yaml"
    cfg = load_config([recipe, f"{CONFIGS}/layouts/qwen3.5-35b-a3b/4node.yaml"])
    pl = plan.plan(cfg, Q35, hf_json("qwen3.5-35b-a3b"), plan.GPUS["h100"])
    t = pl.time
    seq = t["avg_prompt_len"] + t["avg_response_len"]
    assert pl.kv_tokens == pytest.approx(pl.kv_pool / 10240)
    want = min(t["seqs_per_engine"], int(pl.kv_tokens // (seq + Q35.state_tokens(4))))
    assert t["concurrent_seqs_per_engine"] == want < int(pl.kv_tokens // seq)


def test_hybrid_configs_refuse_context_parallelism_in_the_plan():
    recipe = f"{CONFIGS}/recipes/qwen3.5-35b-a3b/dapo.yaml"
    cfg = load_config([recipe, f"{CONFIGS}/layouts/qwen3.5-35b-a3b/4node.yaml"], ["parallel.cp=2"])
    pl = plan.plan(cfg, Q35, hf_json("qwen3.5-35b-a3b"), plan.GPUS["h200"])
    assert not pl.fits and any("parallel.cp" in p and "gated delta-net" in p for p in pl.problems)
