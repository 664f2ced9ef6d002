"""Forward-only logits of a vision-language model (images, videos and text) at any TP/PP.

Used by tests and the conversion tool's `verify`. Every row of `input_ids` is one sequence; the
rows run as one packed THD row (as the trainer runs sequences) with their M-RoPE position ids
(`mrope.vision_position_ids`) concatenated, the images of all rows in `pixel_values` /
`image_grid_thw` in row order (HF's layout; videos likewise), through megatron's pipeline schedule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def pack_rows(input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(ids [1, b*s], M-RoPE ids [3, 1, b*s], cu_seqlens) of b rows of length s, rows in order."""
    b, s = input_ids.shape
    return input_ids.reshape(1, b * s), position_ids.reshape(3, 1, b * s), [i * s for i in range(b + 1)]


@torch.no_grad()
def vlm_forward_logits(model_chunks, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                       image_grid_thw: torch.Tensor | None, pixel_values_videos: torch.Tensor | None = None,
                       video_grid_thw: torch.Tensor | None = None, second_per_grid_ts=None) -> torch.Tensor:
    """Logits [b, s, V] (HF vocabulary, TP-gathered, float32, host) on every rank; videos as HF's
    processor gives them (`second_per_grid_ts`: Qwen2.5-VL's seconds per temporal patch)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.builder import unwrap
    from megarl.models.vision.mrope import vision_position_ids
    from megarl.models.attention import thd_params
    from megarl.parallel.distributed import device

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        chunk.eval()
    last = unwrap(chunks[-1])
    v = last.arch_spec.vision
    pos, _ = vision_position_ids(input_ids, v, image_grid_thw, video_grid_thw, second_per_grid_ts)
    ids, pos, cu = pack_rows(input_ids.cpu(), pos)
    ids, pos = ids.to(device()), pos.to(device())
    params = thd_params(cu, device=device())
    images = {} if pixel_values is None else {"pixel_values": pixel_values.to(device()),
                                              "image_grid_thw": image_grid_thw.cpu()}
    if pixel_values_videos is not None:
        images.update(pixel_values_videos=pixel_values_videos.to(device()), video_grid_thw=video_grid_thw.cpu())

    def step(data_iter, model):
        return model(next(data_iter), pos, None, packed_seq_params=params, **images), None

    if ps.get_pipeline_model_parallel_world_size() == 1 and len(chunks) == 1:
        out = chunks[0](ids, pos, None, packed_seq_params=params, **images)
    else:
        iters = [iter([ids]) for _ in chunks]
        res = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters if len(chunks) > 1 else iters[0], model=list(chunks),
            num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
        out = res[0] if ps.is_pipeline_last_stage() else None
    b, s = input_ids.shape
    if out is not None:
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out[0].float())[..., : last.hf_vocab_size]
        out = out.reshape(b, s, -1).contiguous()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        if out is None:
            out = torch.empty(b, s, last.hf_vocab_size, dtype=torch.float32, device=device())
        dist.broadcast(out, src=src, group=group)
    return out.cpu()
