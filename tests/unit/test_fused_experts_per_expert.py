"""A Qwen3.5-MoE checkpoint with fused experts (the released checkpoints' form: `mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]; also the older [E, H, 2I] / [E, I, H]) is read per
expert by HFCheckpoint (megarl.weights.expert_layout.per_expert_views): the same tensors as the
per-expert file transformers writes, sliced on disk; the builtin engine and `megarl convert verify`
(HF vs Megatron logits and gradients) run from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.weights import HFCheckpoint
from tests.distributed.scripts_hybrid import make_tiny
from tests.distributed.scripts_qwen3_vl_common import make_prompt

REPO = Path(__file__).resolve().parents[2]


def fuse(per_expert: dict[str, torch.Tensor], experts: int, transformers5: bool) -> dict[str, torch.Tensor]:
    """The per-expert file's tensors with each layer's experts stacked into the two fused tensors."""
    out = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    bases = {k.split(".mlp.experts.")[0] for k in per_expert if ".mlp.experts." in k}
    for b in bases:
        e = lambda i, p: per_expert[f"{b}.mlp.experts.{i}.{p}.weight"]  # noqa: E731
        gate_up = torch.stack([torch.cat([e(i, "gate_proj"), e(i, "up_proj")]) for i in range(experts)])  # [E, 2I, H]
        down = torch.stack([e(i, "down_proj") for i in range(experts)])  # [E, H, I]
        if not transformers5:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{b}.mlp.experts.gate_up_proj"], out[f"{b}.mlp.experts.down_proj"] = gate_up.contiguous(), down.contiguous()
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    per_expert = make_tiny("qwen3_5_moe", root / "per_expert", seed=5)
    tensors = load_file(per_expert / "model.safetensors")
    out = {"per_expert": per_expert, "tensors": tensors}
    for name, t5 in (("transformers5", True), ("released", False)):
        d = root / name
        d.mkdir()
        for f in per_expert.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(fuse(tensors, 4, t5), str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = d
    return out


@pytest.mark.parametrize("layout", ["transformers5", "released"])
def test_fused_file_reads_per_expert(dirs, layout):
    ckpt = HFCheckpoint(dirs[layout])
    assert ckpt.expert_layout == layout
    assert ckpt.names() == set(dirs["tensors"])  # no fused names left, every per-expert one there
    for name, want in dirs["tensors"].items():
        assert ckpt.shape(name) == tuple(want.shape), name
        assert torch.equal(ckpt.read(name), want), name
    g = "model.language_model.layers.1.mlp.experts.2.gate_proj.weight"
    d = "model.language_model.layers.3.mlp.experts.3.down_proj.weight"
    assert torch.equal(ckpt.read(g, 0, 8, 24), dirs["tensors"][g][8:24])  # the rows a TP rank reads
    assert torch.equal(ckpt.read(d, 1, 16, 32), dirs["tensors"][d][:, 16:32])


def test_transformers_reads_the_fused_file_as_released_checkpoints_are_read(dirs):
    # the fused [E, 2I, H] file is what transformers itself loads (no per-expert conversion): the same
    # logits (to 1e-5: the two loads leave the fused parameters in different memory layouts)
    ids = torch.tensor([[1, 5, 9, 33, 60, 7]])
    logits = [transformers.AutoModelForImageTextToText.from_pretrained(dirs[k], dtype=torch.float32).eval()(
        input_ids=ids).logits for k in ("per_expert", "transformers5")]
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)


def test_builtin_engine_from_the_fused_file(dirs):
    prompts = [make_prompt([(20, 37)], seed=1), make_prompt(seed=3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    runs = [BuiltinEngine.from_pretrained(dirs[k], tokenizer=None).generate(
        [p for p, _ in prompts], params, images=[i for _, i in prompts]) for k in ("per_expert", "transformers5")]
    for a, b in zip(*runs):
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs


def test_convert_verify_from_the_fused_file(dirs):
    out = subprocess.run([sys.executable, "-m", "megarl.convert.cli", "verify", "--hf", str(dirs["transformers5"]),
                          "--tol", "1e-4", "--grad", "--seq", "12", "--batch", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "max_abs_logit_diff=" in out.stdout and "max_rel_grad_diff=" in out.stdout, out.stdout[-2000:]
