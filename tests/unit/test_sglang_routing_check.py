"""tools/smoke/sglang_routing.py (the MoE part of tools/gpu_smoke.py's `sglang` check) on CPU: the
builtin engine records routed experts in the layout megarl reads from SGLang, so its samples pass
the check and HF agrees with every (token, layer); samples one token off, with swapped layers, of
the wrong shape or without the last token's placeholder row fail it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _tool():
    from tools.smoke import sglang_routing

    return sglang_routing


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megarl.rollout import BuiltinEngine, SamplingParams

    tool = _tool()
    path = tool.tiny_moe_dir(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe")  # a child process writes it
    engine = BuiltinEngine.from_pretrained(path)
    samples = engine.generate([[5, 6, 7, 8], [20, 21, 22]], SamplingParams(temperature=0.0, max_new_tokens=6))
    samples += engine.generate([[40, 41, 42]], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1, fire=True))
    return tool, path, samples


def test_moe_shape_reads_the_lm_config():
    tool = _tool()
    assert tool.moe_shape({"num_hidden_layers": 48, "num_experts_per_tok": 8, "num_experts": 128}) == (48, 8, 128)
    assert tool.moe_shape({"text_config": {"num_hidden_layers": 4, "num_experts_per_tok": 2,
                                           "num_experts": 6}, "vision_config": {}}) == (4, 2, 6)
    assert tool.moe_shape({"num_hidden_layers": 2, "intermediate_size": 8}) is None


def test_engine_routing_passes_and_agrees_with_hf(moe):
    tool, path, samples = moe
    from megarl.weights.hf_reader import read_config

    shape = tool.moe_shape(read_config(path))
    assert shape == (2, 2, 8)
    assert tool.reference_agreement(samples, path) == 1.0  # fp32 builtin engine vs fp32 HF
    assert "agreement 1.000" in tool.verdict(samples, shape, path)


def test_misplaced_or_malformed_routing_fails(moe):
    tool, path, samples = moe
    shape = (2, 2, 8)

    def each(fn):
        return [dataclasses.replace(s, routed_experts=fn(s.routed_experts)) for s in samples]

    with pytest.raises(ValueError, match="agreement"):  # rows one token late
        tool.verdict(each(lambda r: torch.cat([r[:1], r[:-2], r[-1:]])), shape, path)
    with pytest.raises(ValueError, match="agreement"):
        tool.verdict(each(lambda r: r.flip(1)), shape, path)  # layers swapped
    with pytest.raises(ValueError, match="expected"):
        tool.check_routed_experts(each(lambda r: r[:-1]), shape)  # prompt + response - 1 rows
    with pytest.raises(ValueError, match="expected"):
        tool.check_routed_experts(each(lambda r: r.to(torch.int32)), shape)
    with pytest.raises(ValueError, match="never forwarded"):
        tool.check_routed_experts(each(lambda r: torch.cat([r[:-1], r[-1:] + 1])), shape)
    with pytest.raises(ValueError, match="repeated"):
        tool.check_routed_experts(each(lambda r: r[..., :1].expand(r.shape).clone()), shape)
    with pytest.raises(ValueError, match="outside"):
        tool.check_routed_experts(each(lambda r: r + 8), shape)
    with pytest.raises(ValueError, match="no routed_experts"):
        tool.check_routed_experts(each(lambda r: None), shape)
