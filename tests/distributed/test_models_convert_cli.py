"""tools/convert_checkpoint.py end to end: hf-to-megatron at TP=2 (torchrun, 2 ranks) ->
megatron-to-hf (sharded safetensors + index) -> transformers.from_pretrained -> equal tensors;
`verify` at PP=2 prints the diff line and fails above --tol; bad inputs give one clear error."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import CPU_ONLY, convert, convert_ok, last_value
from tests.distributed.scripts_models_common import make_tiny_hf

pytestmark = CPU_ONLY


def save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(100)} | {"<unk>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def test_cli_roundtrip_and_verify(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = make_tiny_hf("qwen2", tmp_path / "hf", seed=5)
    save_tokenizer(hf)
    convert_ok("hf-to-megatron", "--hf", hf, "--out", tmp_path / "ckpt", "--tp", 2)
    assert (tmp_path / "ckpt/model/metadata.json").exists()
    assert (tmp_path / "ckpt/hf/tokenizer.json").exists()

    # ~110 kB shards: the 440 kB model is written as several files with an index
    convert_ok("megatron-to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf2", "--max-shard-gb", 1e-4)
    index = json.loads((tmp_path / "hf2/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", dtype=torch.float32)
    original = load_file(hf / "model.safetensors")
    loaded = model.state_dict()
    assert set(loaded) == set(original)
    for name, t in original.items():
        assert torch.equal(loaded[name], t), name
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf2")
    assert tok.convert_tokens_to_ids("w7") == 7

    assert last_value(convert_ok("verify", "--hf", tmp_path / "hf2", "--tp", 1, "--pp", 2)) < 1e-4


def test_cli_errors_name_the_problem(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50).save_pretrained(tmp_path / "gpt2")
    r = convert("verify", "--hf", tmp_path / "gpt2", "--tp", 2)
    assert r.returncode != 0
    assert "model_type='gpt2'" in r.stderr and "qwen2" in r.stderr, r.stderr[-2000:]

    hf = make_tiny_hf("llama3", tmp_path / "llama", seed=1)
    # TP=2 splits the matmuls' reductions, so fp32 rounding (~1e-6) exceeds this tolerance (at TP=1
    # the local attention runs the same SDPA kernel as HF and the logits can be bit-equal)
    r = convert("verify", "--hf", hf, "--tp", 2, "--tol", 1e-12)
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert 1e-12 < last_value(r.stdout) < 1e-4

    (hf / "model.safetensors").write_bytes(b"\x00garbage")
    r = convert("hf-to-megatron", "--hf", hf, "--out", tmp_path / "o", "--tp", 2)
    assert r.returncode != 0 and "model.safetensors" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("family, layout", [
    ("qwen2", ["--cp", 2]), ("qwen3", ["--cp", 2]), ("llama3", ["--cp", 2]),
    ("qwen2", ["--tp", 2, "--cp", 2]), ("llama3", ["--pp", 2, "--cp", 2]),
])
def test_verify_context_parallel_packed_logits_and_grads(tmp_path, family, layout):
    """GQA models, packed sequences of random lengths (1..19, mostly not multiples of 2*CP): the
    logits and the gradients of the summed log-likelihood equal HF's."""
    hf = make_tiny_hf(family, tmp_path / family, seed=3)
    out = convert_ok("verify", "--hf", hf, *layout, "--packed", "--grad", "--batch", 3, "--seq", 19)
    logit_diff, grad_diff = last_value(out, line=-2), last_value(out, "max_rel_grad_diff")
    assert logit_diff < 1e-4 and grad_diff < 1e-4
    assert grad_diff > 0  # two different computations, not one compared with itself
