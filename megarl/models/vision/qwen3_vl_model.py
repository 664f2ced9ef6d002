"""Qwen3-VL and Qwen3-VL-MoE on megatron-core: `Qwen2_5_VLModel`'s structure (GPTModel + vision
tower on the first pipeline stage, images and videos written at their placeholder tokens) with the
Qwen3 or Qwen3-MoE LM, the Qwen3-VL tower (`qwen3_vl_tower`), interleaved M-RoPE and DeepStack.

Interleaved M-RoPE: megatron-core 0.16.1's `MultimodalRotaryEmbedding` gives each of the t / h / w
axes a contiguous block of frequencies (its `rotary_interleaved` is the pairing of rotated channels,
a different thing), so `InterleavedMRoPE` replaces it: frequency i rotates by the position id of axis
`qwen3_vl_geometry.interleaved_mrope_axes(section)[i]` (t, h, w, t, h, w, ... then t), as HF.

DeepStack: the tower also returns K features per image token (K = len(deepstack_visual_indexes));
HF adds feature k to the hidden states at the image tokens after LM layer k (k < K):

    h_k[image tokens] += deepstack_k        (h_k: output of decoder layer k, 0-based)

Here `embed` scatters the features into dense addends [K, s, b, h] (zero outside the image and
video tokens, each modality's features at its own placeholders, HF's joint visual mask;
under sequence parallelism this rank's slice of s, the features' gradients then all-reduced over TP
like those of the scattered input embeddings), which reach megatron's `TransformerBlock` as its
`context` argument (a decoder-only layer passes it through untouched: its cross-attention is an
identity) and a forward hook on each of the first K layers adds addends[k] to the layer's output.
Being a block argument, the addends are an input of megatron's activation-recompute checkpoints, so
full recompute re-adds them and their gradients reach the DeepStack mergers. All K layers must sit
on the first pipeline stage (checked at build time): `context` does not cross pipeline stages.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from megarl.models.vision.model import Qwen2_5_VLModel
from megarl.models.vision.qwen3_vl_geometry import interleaved_mrope_angles, interleaved_mrope_axes
from megarl.models.vision.qwen3_vl_tower import Qwen3VisionTransformer


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """megatron's M-RoPE module with Qwen3-VL's interleaved frequency assignment (module doc);
    returns the angles [s, b, 1, head_dim] megatron's attention applies (rotate-half layout)."""

    def __init__(self, kv_channels: int, rotary_base: float, rotary_percent: float = 1.0):
        super().__init__(kv_channels=kv_channels, rotary_percent=rotary_percent, rotary_base=rotary_base)

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        if cp_group is not None and cp_group.size() > 1:
            raise ValueError("interleaved M-RoPE does not support context parallelism")
        axis = interleaved_mrope_axes(mrope_section, self.inv_freq.numel())
        angles = interleaved_mrope_angles(position_ids.to(self.inv_freq.device), self.inv_freq, axis)
        return angles.transpose(0, 1)[:, :, None, :].contiguous()


def deepstack_rows(image_mask: torch.Tensor, sequence_parallel: bool, tp: int, tp_rank: int):
    """(rows, picked) of the image tokens in megatron's [s, b] layout flattened (row = t * b + r for
    token t of row r), in HF's row-major [b, s] order; under sequence parallelism only the tokens of
    this rank's slice [tp_rank * s / tp, (tp_rank + 1) * s / tp), as rows of that slice, with `picked`
    the indices of those tokens among all image tokens (None: all)."""
    b, s = image_mask.shape
    r, t = image_mask.nonzero(as_tuple=True)
    rows = t * b + r
    if not sequence_parallel or tp == 1:
        return rows, None
    per = s // tp * b
    mine = (rows >= tp_rank * per) & (rows < (tp_rank + 1) * per)
    return rows[mine] - tp_rank * per, mine.nonzero(as_tuple=True)[0]


class Qwen3VLMoeModel(Qwen2_5_VLModel):
    """GPTModel (Qwen3-MoE LM, interleaved M-RoPE) + Qwen3-VL tower and DeepStack (module doc)."""

    tower_class = Qwen3VisionTransformer

    def __init__(self, *, arch_spec, **gpt_kwargs):
        super().__init__(arch_spec=arch_spec, **gpt_kwargs)
        self.rotary_pos_emb = InterleavedMRoPE(self.config.kv_channels, gpt_kwargs.get("rotary_base", 10000),
                                               arch_spec.rotary_percent)  # Qwen3.5: the first quarter of a head
        indexes = arch_spec.vision.deepstack_visual_indexes
        self.deepstack_levels = len(indexes)
        first = _first_stage_layers(self.config)
        if self.deepstack_levels > first:
            raise ValueError(
                f"{arch_spec.model_type}: the {self.deepstack_levels} DeepStack features (vision_config."
                f"deepstack_visual_indexes={list(indexes)}) are added after LM layers 0..{self.deepstack_levels - 1}, "
                f"but the first pipeline stage holds only {first} layer(s); lower pipeline_model_parallel_size "
                f"(or set num_layers_in_first_pipeline_stage >= {self.deepstack_levels})")
        self._deepstack = None  # addends [K, s, b, h] from `embed` until the decoder call of the same forward
        if self.pre_process and self.deepstack_levels:
            self.decoder.register_forward_pre_hook(self._pass_deepstack_to_decoder, with_kwargs=True)
            for layer in self.decoder.layers:
                level = layer.layer_number - 1
                if level < self.deepstack_levels:
                    layer.register_forward_hook(_add_deepstack(level, self.deepstack_levels), with_kwargs=True)

    def image_embeddings(self, pixel_values, image_grid_thw, image_mask):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        image, features = self.vision_model(pixel_values, image_grid_thw)
        if features and int(image_mask.sum()) == image.shape[0]:
            tp = ps.get_tensor_model_parallel_world_size()
            sp = self.config.sequence_parallel and tp > 1
            rows, picked = deepstack_rows(image_mask.to(image.device), sp, tp, ps.get_tensor_model_parallel_rank())
            if picked is not None:  # each TP rank adds its slice's rows: their gradients sum over TP
                features = [copy_to_tensor_model_parallel_region(f)[picked] for f in features]
            b, s = image_mask.shape
            local = s // tp if sp else s
            addends = self._deepstack  # the images' when these are a video's (disjoint rows)
            if addends is None:
                addends = image.new_zeros(len(features), local, b, image.shape[-1])
            self._deepstack = addends.view(len(features), local * b, -1).index_copy(
                1, rows, torch.stack(features)).view(len(features), local, b, -1)
        return image

    def _pass_deepstack_to_decoder(self, module, args, kwargs):
        addends, self._deepstack = self._deepstack, None
        if addends is None:
            return None
        if kwargs.get("context") is not None:
            raise ValueError("Qwen3-VL passes its DeepStack features as the decoder's `context`")
        return args, {**kwargs, "context": addends}

    def embed(self, input_ids, *args, **kwargs):
        self._deepstack = None
        return super().embed(input_ids, *args, **kwargs)

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._deepstack = None


def _add_deepstack(level: int, levels: int):
    """Forward hook of decoder layer `level`: its output hidden states + the level's addends; the last
    level ends the addends' trip through the block (later layers get no `context`, and no
    recompute checkpoint returns an unused tensor)."""

    def hook(module, args, kwargs, output):
        addends = kwargs.get("context")
        if addends is None:
            return output
        hidden, context = output
        return hidden + addends[level].to(hidden.dtype), (None if level == levels - 1 else context)

    return hook


def _first_stage_layers(config) -> int:
    """Decoder layers of the first model chunk of pipeline rank 0 (where the embedding lives)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    vp = 0 if config.virtual_pipeline_model_parallel_size else None
    return get_num_layers_to_build(config, vp_stage=vp, pp_rank=0)
