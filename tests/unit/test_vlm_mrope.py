"""M-RoPE position ids (megarl.models.vision.mrope) vs HF's `Qwen2_5_VLModel.get_rope_index`, and
the M-RoPE rotation they feed vs HF's rotary module."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from megarl.models.vision.mrope import image_positions, mrope_position_ids
from tests.distributed.scripts_vlm_common import IMAGE, VIDEO, random_batch, tiny_vlm_config


@pytest.fixture(scope="module")
def hf_model():
    return transformers.Qwen2_5_VLModel(tiny_vlm_config()).eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_position_ids_equal_hf_get_rope_index(hf_model, seed):
    sizes = [((20, 37), (48, 40), (9, 9), (33, 18)), ((64, 16), (16, 64)), ((17, 23),)][seed]
    ids, _, grid, mm = random_batch(seed, sizes=sizes, rows=min(2, len(sizes)))
    pos, delta = mrope_position_ids(ids, grid, IMAGE, 2)
    ref_pos, ref_delta = hf_model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid)
    assert pos.shape == (3, ids.shape[0], ids.shape[1])
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)
    assert not torch.equal(pos[1], pos[2])  # the images really have 2D positions


def test_position_ids_with_padding_equal_hf(hf_model):
    ids, _, grid, mm = random_batch(4, sizes=((20, 37), (9, 9)), rows=2)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    mask[0, :1] = 0  # left padding (a text token)
    pos, delta = mrope_position_ids(ids, grid, IMAGE, 2, attention_mask=mask)
    ref_pos, ref_delta = hf_model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid,
                                                 attention_mask=mask)
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)


def test_text_only_and_image_layout():
    pos, delta = mrope_position_ids(torch.tensor([[5, 6, 7]]), None, IMAGE, 2)
    assert torch.equal(pos, torch.arange(3).expand(3, 1, 3)) and delta.tolist() == [[0]]
    # grid (1, 4, 6) -> 2 x 3 merged tokens at offset 10: t = 10, h = 10 + i, w = 10 + j
    assert image_positions(10, (1, 4, 6), 2).tolist() == [[10] * 6, [10, 10, 10, 11, 11, 11],
                                                          [10, 11, 12, 10, 11, 12]]


def test_bad_inputs_are_refused():
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="does not match"):  # two images without a separator
        mrope_position_ids(torch.tensor([[1] + [IMAGE] * 8 + [2]]), torch.tensor([[1, 4, 4]] * 2), IMAGE, 2)
    with pytest.raises(ValueError, match="more images"):
        mrope_position_ids(torch.tensor([[1, 2]]), grid, IMAGE, 2)
    with pytest.raises(ValueError, match="more image-token runs"):
        mrope_position_ids(torch.tensor([[IMAGE] * 4]), None, IMAGE, 2)
    with pytest.raises(ValueError, match="video"):
        mrope_position_ids(torch.tensor([[VIDEO, 1]]), None, IMAGE, 2, video_token_id=VIDEO)


def test_megatron_mrope_rotation_equals_hf_rotary_module():
    """megatron's own MultimodalRotaryEmbedding.forward on these ids == HF's cos/sin (its __init__
    only computes inv_freq on the CUDA device, so the module is assembled by hand here)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    cfg = tiny_vlm_config().text_config
    rope = Qwen2_5_VLRotaryEmbedding(cfg)
    ids, _, grid, _ = random_batch(0)
    pos, _ = mrope_position_ids(ids, grid, IMAGE, 2)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)  # [b, s, d]
    mm = MultimodalRotaryEmbedding.__new__(MultimodalRotaryEmbedding)
    torch.nn.Module.__init__(mm)
    mm.inv_freq, mm.rotary_interleaved, mm.seq_len_interpolation_factor, mm.cp_group = rope.inv_freq, False, None, None
    emb = mm(pos, [2, 3, 3])  # [s, b, 1, d] rotation angles
    assert emb.shape == (ids.shape[1], ids.shape[0], 1, 16)
    emb = emb[:, :, 0].transpose(0, 1)
    assert torch.allclose(emb.cos(), cos, atol=1e-6) and torch.allclose(emb.sin(), sin, atol=1e-6)
