"""Tiny random Qwen2.5-VL models, images and prompts for the vision-language tests.

Text vocabulary 160 (not a multiple of 128: TP vocab padding is exercised), image placeholder
token 150, vision start / end 152 / 153; vision tower: 2 blocks (block 1 full attention, block 0
windowed with 2x2 merged tokens a window), hidden 32, 2 heads, patch 4, merge 2; LM: 2 layers,
hidden 64, GQA 4/2 heads, M-RoPE sections [2, 3, 3]. Images go through HF's own image processor
(`Qwen2VLImageProcessorPil`, built locally), so pixel_values / image_grid_thw are what HF's
processor produces. Weights are drawn with larger scales than HF's init, so logits are O(1).
Also the gradient comparison both vision-language model scripts make (`megatron_grads`, `rel_diff`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers

from tests.distributed.harness import on_rank0
from tests.distributed.scripts_models_common import save_random

IMAGE, VSTART, VEND, VIDEO = 150, 152, 153, 151
TEXT_VOCAB = 150  # text tokens are drawn from [0, 150)


def tiny_vlm_config(tie: bool = False):
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def image_processor():
    return transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 64)


def make_tiny_vlm(path: str | Path, seed: int = 0, tie: bool = False) -> Path:
    save_random(lambda: transformers.Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(tie)).float(), path, seed,
                norm=lambda name: "norm" in name or "ln_q" in name)
    return Path(path)


def shared_tiny_vlm(path: Path, seed: int = 3):
    """`make_tiny_vlm` at path on rank 0 (the other ranks wait for it); its HF config, on every rank."""
    on_rank0(make_tiny_vlm, path, seed=seed)
    return transformers.AutoConfig.from_pretrained(path)


def random_batch(seed: int, sizes=((20, 37), (48, 40), (9, 9), (33, 18)), rows: int = 2, extra_text: int = 5):
    """(input_ids [rows, s], pixel_values, image_grid_thw, mm_token_type_ids): random RGB images of
    the given (height, width) pixels through the image processor, dealt to the rows in order (row 0
    the first ones: HF's row-major image order), each image as <vision_start> <IMAGE x n>
    <vision_end> between random text; rows topped up with text to one length (no attention mask)."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    proc = image_processor()(images=images, return_tensors="pt")
    grid = proc["image_grid_thw"]
    counts = (grid.prod(-1) // 4).tolist()
    text = lambda n: rng.integers(0, TEXT_VOCAB, n).tolist()  # noqa: E731
    seqs = [[] for _ in range(rows)]
    for k, n in enumerate(counts):
        seqs[k * rows // len(counts)] += text(int(rng.integers(1, 4))) + [VSTART] + [IMAGE] * n + [VEND]
    length = max(len(s) for s in seqs) + extra_text
    ids = torch.tensor([s + text(length - len(s)) for s in seqs])
    return ids, proc["pixel_values"], grid, (ids == IMAGE).int()


@torch.no_grad()
def hf_vlm_logits(path, ids, pixel_values, grid, mm_types) -> torch.Tensor:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                 mm_token_type_ids=mm_types).logits.float()


def make_prompt(sizes, seed: int):
    """(token ids, HF image-processor output or None): text, then each image framed by vision
    start / end tokens and followed by text."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150, 3).tolist()
    if not sizes:
        return ids + rng.integers(0, 150, 5).tolist(), None
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    proc = image_processor()(images=images, return_tensors="pt")
    for n in (proc["image_grid_thw"].prod(-1) // 4).tolist():
        ids += [VSTART] + [IMAGE] * n + [VEND] + rng.integers(0, 150, 2).tolist()
    return ids, {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}


def log_likelihood(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over rows and t of log softmax(logits[:, t])[ids[:, t + 1]]."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None].to(logits.device)).sum()


def megatron_grads(model, cfg, batch) -> dict:
    """HF-named gradients of `log_likelihood` of `batch` (random_batch's tuple) through the megatron
    model (PP = 1, the rows packed with their M-RoPE ids; each weight is overwritten by its
    gradient to stream it, so the model is spent afterwards)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megarl.models.attention import thd_params
    from megarl.models.vision.forward import pack_rows
    from megarl.models.vision.mrope import mrope_position_ids
    from megarl.parallel.distributed import device
    from megarl.weights import stream_hf_weights

    ids, pv, grid, _ = batch
    pos, _ = mrope_position_ids(ids, grid, IMAGE, 2)
    row, pos, cu = pack_rows(ids, pos)
    chunk = model[0]
    out = chunk(row.to(device()), pos.to(device()), None, packed_seq_params=thd_params(torch.tensor(cu).to(device())),
                pixel_values=pv.to(device()), image_grid_thw=grid)
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., :160].reshape(*ids.shape, -1)
    log_likelihood(logits, ids).backward()
    config = chunk.config
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            if p.grad is None:  # an expert no token chose
                p.grad = torch.zeros_like(p)
            # megatron's finalize_model_grads: these see only this TP rank's tokens / heads
            if (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            p.copy_(p.grad)
    return {n: t.cpu().clone() for b in stream_hf_weights(model, cfg) for n, t in b}


def rel_diff(got: dict, ref: dict, visual: str) -> dict:
    """The largest |got - ref| / |ref| over ref's tensors (and its name), the names missing from
    got, how many tensors ref has and how many of them start with `visual` (the vision tower's)."""
    worst = max(((float((got[n] - g).norm() / g.norm()), n) for n, g in ref.items() if n in got), default=(0.0, ""))
    return {"max_rel": worst[0], "worst": worst[1], "missing": sorted(set(ref) - set(got))[:5], "n": len(ref),
            "visual": sum(n.startswith(visual) for n in ref)}
