"""Qwen2.5-VL on megatron-core: megatron's `GPTModel` (Qwen2 LM, M-RoPE) plus the vision tower.

`Qwen2_5_VLModel` is a `GPTModel` (same `embedding` / `decoder` / `output_layer`, so megarl's weight
bridge, stream, checkpoints and PP schedules treat its LM like any dense family) built with
`position_embedding_type="mrope"` (megatron's `MultimodalRotaryEmbedding`, sections from
`ArchSpec.mrope_section`). The first pipeline stage also holds `vision_model`
(`megarl.models.vision.tower.VisionTransformer`). Its forward takes, besides GPTModel's arguments,

- `pixel_values` [N, C*tp*p*p] and `image_grid_thw` [n_images, 3] (HF's image processor output;
  used on the first stage only),
- `image_mask` [b, s] (optional): the placeholder positions that hold images (default: every
  `image_token_id`; the trainer passes the prompts' ones, so a placeholder id in a response is text),
- `pixel_values_videos`, `video_grid_thw`, `video_mask`: the same for videos (`video_token_id`
  placeholders; the tower embeds a video's frames like an image's, t > 1),
- `position_ids` [3, b, s] M-RoPE ids (`megarl.models.vision.mrope.mrope_position_ids`, needed on
  every stage), or 2-D [b, s] for text only: then every token gets (p, p, p), with p its position
  within its own sequence of a packed THD row (the packed row's offsets are not positions).

On the first stage the input embeddings are the word embeddings with the image embeddings written,
in order, at the `image_token_id` placeholders (row-major over [b, s], as HF's masked_scatter), then
the video embeddings at the `video_token_id` ones; under sequence parallelism they are scattered
over TP only after that.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from megarl.models.vision.tower import VisionTransformer


def text_mrope_positions(position_ids: torch.Tensor, packed_seq_params) -> torch.Tensor:
    """[3, b, s] M-RoPE ids of text-only tokens from 2-D position ids [b, s]: (p, p, p) with
    p = position_ids, or for a packed THD row p = index - start of the token's sequence."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        from megarl.models.attention import sequence_coords

        cu = packed_seq_params.cu_seqlens_q_padded
        cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
        if position_ids.shape[-1] == cu[-1]:
            _, pos = sequence_coords(cu, device=position_ids.device)
            position_ids = pos[None].expand(position_ids.shape[0], -1)
    return position_ids[None].expand(3, -1, -1)


class Qwen2_5_VLModel(GPTModel):
    """GPTModel + Qwen2.5-VL vision tower on the first pipeline stage (module doc)."""

    tower_class = VisionTransformer  # built as tower_class(arch_spec, lm_config)

    def __init__(self, *, arch_spec, **gpt_kwargs):
        gpt_kwargs.update(position_embedding_type="mrope", scatter_embedding_sequence_parallel=False)
        super().__init__(**gpt_kwargs)
        if self.config.context_parallel_size > 1:
            raise ValueError(f"{arch_spec.model_type} does not support context parallelism yet")
        self.image_token_id = arch_spec.vision.image_token_id
        self.video_token_id = arch_spec.vision.video_token_id
        self.vision_model = self.tower_class(arch_spec, self.config) if self.pre_process else None

    def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw, image_mask: torch.Tensor) -> torch.Tensor:
        """[n_image_tokens, h] embeddings of the images (or videos), in placeholder order (image_mask
        [b, s]: their placeholders)."""
        return self.vision_model(pixel_values, image_grid_thw)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None, image_mask=None,
              pixel_values_videos=None, video_grid_thw=None, video_mask=None) -> torch.Tensor:
        """Decoder input [s, b, h] (the sequence-parallel slice under SP): word embeddings with the
        image and video embeddings at their placeholder tokens (`image_mask` / `video_mask` [b, s]:
        which ones, when not every placeholder id is one, e.g. one a policy generated)."""
        from megatron.core import tensor_parallel

        emb = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], not SP-scattered
        for what, token, pixels, grid, mask in (
                ("image", self.image_token_id, pixel_values, image_grid_thw, image_mask),
                ("video", self.video_token_id, pixel_values_videos, video_grid_thw, video_mask)):
            if mask is None:
                mask = input_ids == token if token is not None else torch.zeros_like(input_ids, dtype=torch.bool)
            if pixels is not None:
                if grid is None:
                    raise ValueError(f"{what} pixels without their grid_thw")
                embeds = self.image_embeddings(pixels, grid, mask)
                if int(mask.sum()) != embeds.shape[0]:
                    raise ValueError(f"{int(mask.sum())} {what} placeholder tokens but the {what}s give "
                                     f"{embeds.shape[0]} embeddings")
                emb = emb.transpose(0, 1).masked_scatter(mask[..., None], embeds.to(emb.dtype)).transpose(0, 1)
            elif bool(mask.any()):
                raise ValueError(f"input_ids hold {what} placeholder tokens but no {what} pixels were given")
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb.contiguous())
        return emb.contiguous()

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, pixel_values=None, image_grid_thw=None, image_mask=None,
                pixel_values_videos=None, video_grid_thw=None, video_mask=None, **kwargs):
        if position_ids is not None and position_ids.dim() == 2:
            position_ids = text_mrope_positions(position_ids, packed_seq_params)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask,
                                       pixel_values_videos, video_grid_thw, video_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                               labels=labels, inference_context=inference_context,
                               packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
                               runtime_gather_output=runtime_gather_output, **kwargs)
