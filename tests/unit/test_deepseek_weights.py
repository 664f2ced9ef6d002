"""DeepSeek-V3's block-FP8 weights (read dequantized slice by slice, written quantized for SGLang), the
fused q_a / kv_a pairs SGLang's DeepSeek loader needs in one bucket, and the planner's account of
multi-latent attention, sigmoid-routed MoE and FP8 engine weights."""

import json

import pytest
import torch
from safetensors.torch import save_file

from megarl.rollout.sglang.weights import keep_partners_together, partner, quantized
from megarl.weights.fp8_blocks import DequantizedCheckpoint, dequantize, dequantized, quantize
from megarl.weights.hf_reader import HFCheckpoint

BLOCK = (4, 6)  # small blocks so that odd shapes have partial edge blocks and slices cross them


def test_quantize_then_dequantize_is_within_e4m3_precision():
    w = torch.randn(10, 15, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 15)
    q, scale = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3) and scale.dtype == torch.float32
    back = dequantize(q, scale, BLOCK)
    assert ((back - w).abs() <= w.abs() / 16 + 1e-6 * scale.max()).all()  # 3 mantissa bits
    # every block uses the format's range: its largest entry is +-448 * scale
    blocks = q.float().abs()
    assert blocks[:4, :6].max() == 448.0 and blocks[8:, 12:].max() == 448.0


@pytest.fixture()
def fp8_dir(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 15, generator=g)
    q, scale = quantize(w, BLOCK)
    save_file({"a.weight": q, "a.weight_scale_inv": scale, "b.weight": torch.randn(3, 5, generator=g)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}}))
    return tmp_path, dequantize(q, scale, BLOCK)


def test_slices_read_dequantized_equal_the_whole_tensor(fp8_dir):
    path, full = fp8_dir
    ckpt = dequantized(HFCheckpoint(path), json.loads((path / "config.json").read_text()))
    assert isinstance(ckpt, DequantizedCheckpoint) and ckpt.names() == {"a.weight", "b.weight"}
    assert torch.equal(ckpt.read("a.weight"), full)
    for dim, (start, stop) in [(0, (0, 5)), (0, (3, 10)), (0, (5, 6)), (1, (2, 13)), (1, (6, 15)), (1, (0, 1))]:
        part = ckpt.read("a.weight", dim, start, stop)
        assert torch.equal(part, full[start:stop] if dim == 0 else full[:, start:stop]), (dim, start, stop)
    assert ckpt.read("b.weight").dtype == torch.float32  # not quantized: as stored


def test_a_plain_checkpoint_is_not_wrapped(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    ckpt = HFCheckpoint(tmp_path)
    assert dequantized(ckpt) is ckpt


def test_fused_pairs_travel_in_one_bucket():
    q, kv = "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    assert partner(q) == kv and partner(kv) == q and partner("model.layers.3.self_attn.o_proj.weight") is None
    assert partner(q + "_scale_inv") == kv + "_scale_inv"
    t = {n: torch.full((2,), float(i)) for i, n in enumerate([q, kv, "o", "p"])}
    stream = [[("o", t["o"]), (q, t[q])], [("p", t["p"])], [(kv, t[kv])]]
    out = list(keep_partners_together(stream))
    assert [[n for n, _ in b] for b in out] == [["o"], ["p"], [q, kv]]
    assert torch.equal(out[2][0][1], t[q])
    together = [[(kv, t[kv]), (q, t[q])]]  # already in one bucket: unchanged
    assert [[n for n, _ in b] for b in keep_partners_together(together)] == [[kv, q]]
    with pytest.raises(RuntimeError, match="without the tensors SGLang fuses"):
        list(keep_partners_together([[(q, t[q])]]))


def test_quantized_stream_sends_fp8_weights_with_their_scales():
    w = torch.randn(9, 7, generator=torch.Generator().manual_seed(2))
    (bucket,) = quantized([[("x.weight", w), ("norm.weight", torch.ones(7))]], {"x.weight"}, BLOCK)
    names = [n for n, _ in bucket]
    assert names == ["x.weight", "x.weight_scale_inv", "norm.weight"]
    q, s = bucket[0][1], bucket[1][1]
    assert q.dtype == torch.float8_e4m3fn and torch.equal(dequantize(q, s, BLOCK), dequantize(*quantize(w, BLOCK), BLOCK))
