"""Checkpoint problems a user can cause give errors that name the tensor and the file."""

import json
import pickle

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megarl.models.families import arch_spec
from megarl.weights.dist_ckpt import _DcpMetadataUnpickler, check_checkpoint_files
from megarl.weights.hf_reader import CheckpointError, HFCheckpoint
from megarl.weights.load_hf import check_checkpoint


def tiny(tmp_path, **kw):
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, **kw)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    return cfg


def test_valid_checkpoint_passes_and_slices(tmp_path):
    cfg = tiny(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    check_checkpoint(ckpt, arch_spec(cfg))
    full = load_file(tmp_path / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(ckpt.read("model.layers.1.mlp.down_proj.weight", 1, 8, 16), full[:, 8:16])
    assert torch.equal(ckpt.read("model.layers.1.mlp.down_proj.weight", 0, 2, 5), full[2:5])


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        HFCheckpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFCheckpoint(tmp_path / "empty")
    tiny(tmp_path / "sharded")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "sharded/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is listed in"):
        HFCheckpoint(tmp_path / "sharded")


def test_corrupt_and_truncated_safetensors(tmp_path):
    tiny(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        HFCheckpoint(tmp_path).read("model.norm.weight")
    path.write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"cannot open safetensors file .*model\.safetensors"):
        HFCheckpoint(tmp_path)


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    cfg = tiny(tmp_path)
    spec = arch_spec(cfg)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)

    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.1.self_attn.k_proj.bias"):
        check_checkpoint(HFCheckpoint(tmp_path), spec)

    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(8)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"does not map .*model\.layers\.0\.mlp\.extra\.weight"):
        check_checkpoint(HFCheckpoint(tmp_path), spec)

    del tensors["model.layers.0.mlp.extra.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(20, 16)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
                                              r"in .*model\.safetensors: checkpoint has \(20, 16\).*expects \(24, 16\)"):
        check_checkpoint(HFCheckpoint(tmp_path), spec)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_dcp_metadata_unpickler_refuses_foreign_globals(tmp_path):
    blob = pickle.dumps({"x": _Evil()})
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        _DcpMetadataUnpickler(open_bytes(tmp_path, blob)).load()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "metadata.json").write_text("{}")
    (model_dir / ".metadata").write_bytes(blob)
    torch.save({}, model_dir / "common.pt")
    with pytest.raises(CheckpointError, match=r"\.metadata: not valid torch DCP metadata"):
        check_checkpoint_files(model_dir)
    (model_dir / "common.pt").unlink()
    with pytest.raises(CheckpointError, match="common.pt is missing"):
        check_checkpoint_files(model_dir)


def open_bytes(tmp_path, blob):
    p = tmp_path / "blob.pkl"
    p.write_bytes(blob)
    return open(p, "rb")
