"""A tiny random Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) with a byte-level tokenizer and
a small-image processor, built offline for the VLM quickstart.

Tokenizer: `megarl.tasks.tiny_model.build_byte_tokenizer` (ids 0..255 the bytes, then
``<|endoftext|>`` (EOS and pad), ``<|im_start|>``, ``<|im_end|>``) plus the vision special tokens
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>`` (ids 259..262);
the config's `vision_start_token_id` / `vision_end_token_id` / `image_token_id` / `video_token_id`
are those ids and `vocab_size` is the tokenizer size rounded up to `vocab_multiple` (320).

Model: the text quickstart's LM (3 layers, hidden 128, 4 heads / 2 kv heads, SwiGLU 384, q/k/v
biases) with M-RoPE sections (4, 6, 6) over head_dim 32; vision tower: 2 blocks (block 1 full
attention, block 0 windowed with a 64-pixel window, i.e. one window for task-sized images), hidden
64, 2 heads, patch 4, temporal patch 2, 2x2 merge, so one image token covers 8x8 pixels: a 48x48
image is 12x12 patches -> 36 image tokens. HF's own initialisation (`initializer_range` 0.02), fp32.

Processor files: the tokenizer's and a `Qwen2VLImageProcessorPil`'s (patch 4, merge 2, pixels
clamped to [`min_pixels`, `max_pixels`] = [16x16, 64x64]; `AutoImageProcessor` loads it), from
which `AutoProcessor` assembles a `Qwen2_5_VLProcessor`; in the text,
``<|vision_start|><|image_pad|><|vision_end|>`` (`VISION_PLACEHOLDER`) marks an image and the
processor repeats ``<|image_pad|>`` once per image token. transformers 5.19's `Qwen2_5_VLProcessor`
also needs a video processor, which needs torchvision: without torchvision installed
`AutoProcessor.from_pretrained` raises ImportError for every qwen2_5_vl checkpoint (this one
included) and only `AutoImageProcessor` + `AutoTokenizer` load. Task prompts mark images with
``<image>`` (`IMAGE_MARKER`); `expand_image_markers` turns those into placeholders. HF's model
uses M-RoPE only when given `mm_token_type_ids` (1 at image pads), silently 1-D positions without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megarl.tasks.tiny_model import EOS_TOKEN, build_byte_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VISION_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
IMAGE_MARKER = "<image>"

# the byte tokenizer's chat template, where a message's content may also be a list of
# {"type": "text", "text": ...} / {"type": "image"} items (Qwen2.5-VL's convention)
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}" + VISION_PLACEHOLDER
    + "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinyVLMSpec:
    """Sizes of the tiny Qwen2.5-VL (see the module docstring for the defaults' consequences)."""

    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    mrope_section: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim / 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    vocab_multiple: int = 64
    initializer_range: float = 0.02
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    vision_intermediate: int = 128
    patch_size: int = 4
    temporal_patch_size: int = 2
    merge_size: int = 2
    window_size: int = 64  # pixels; windows of window_size // (patch * merge) merged tokens a side
    fullatt_block_indexes: tuple[int, ...] = field(default=(1,))
    min_pixels: int = 16 * 16
    max_pixels: int = 64 * 64


def build_vlm_tokenizer() -> Any:
    """The byte tokenizer with the vision special tokens appended (ids 259..262)."""
    tok = build_byte_tokenizer()
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def tiny_vlm_config(tokenizer: Any, spec: TinyVLMSpec) -> Any:
    """The `Qwen2_5_VLConfig` of `spec`, with the vision token ids of `tokenizer`."""
    import transformers

    head_dim = spec.hidden // spec.heads
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"tiny VLM: hidden {spec.hidden} must divide by heads {spec.heads}, and heads by "
                         f"kv_heads {spec.kv_heads}")
    if len(spec.mrope_section) != 3 or sum(spec.mrope_section) != head_dim // 2:
        raise ValueError(f"tiny VLM: mrope_section {spec.mrope_section} must be 3 sections summing to "
                         f"head_dim/2 = {head_dim // 2}")
    if spec.vision_hidden % spec.vision_heads:
        raise ValueError(f"tiny VLM: vision_hidden {spec.vision_hidden} must divide by "
                         f"vision_heads {spec.vision_heads}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    vocab = math.ceil(len(tokenizer) / spec.vocab_multiple) * spec.vocab_multiple
    text = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6, use_sliding_window=False,
        initializer_range=spec.initializer_range, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section),
                         "rope_theta": spec.rope_theta})
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
        num_heads=spec.vision_heads, in_channels=3, patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size, spatial_merge_size=spec.merge_size,
        window_size=spec.window_size, fullatt_block_indexes=list(spec.fullatt_block_indexes),
        out_hidden_size=spec.hidden, hidden_act="silu", initializer_range=spec.initializer_range)
    return transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        dtype="float32")


def build_tiny_vlm(tokenizer: Any, spec: TinyVLMSpec, seed: int = 0) -> Any:
    """A randomly initialised `Qwen2_5_VLForConditionalGeneration` (fp32) of `spec`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = tiny_vlm_config(tokenizer, spec)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32)


def build_image_processor(spec: TinyVLMSpec) -> Any:
    """HF's PIL Qwen2-VL image processor at the tower's patch / merge sizes and small pixel bounds."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                                    merge_size=spec.merge_size, min_pixels=spec.min_pixels,
                                    max_pixels=spec.max_pixels)


def expand_image_markers(text: str) -> str:
    """`text` with every ``<image>`` replaced by the processor's placeholder
    ``<|vision_start|><|image_pad|><|vision_end|>``."""
    return text.replace(IMAGE_MARKER, VISION_PLACEHOLDER)


def save_tiny_vlm(out_dir: str | Path, spec: TinyVLMSpec | None = None, seed: int = 0, model: Any = None) -> Path:
    """Build (unless given) and save the model (safetensors), generation config, tokenizer and
    processor into `out_dir`; `AutoProcessor` / `AutoTokenizer` / `AutoConfig` load it back."""
    from transformers import GenerationConfig

    spec = spec or TinyVLMSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    model = model if model is not None else build_tiny_vlm(tokenizer, spec, seed)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=eos, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    build_image_processor(spec).save_pretrained(out)  # preprocessor_config.json
    return out
