"""What the weight stream needs on its way into SGLang 0.5.23 for DeepSeek-V3 / Kimi-K2 / GLM-4.5.

- Fused pairs (`keep_partners_together`): SGLang's DeepSeek loader
  (srt/models/deepseek_common/deepseek_weight_loader.py `do_load_weights`, with q_lora_rank set)
  loads `self_attn.q_a_proj` and `self_attn.kv_a_proj_with_mqa` of a layer as one fused parameter
  (`fused_qkv_a_proj_with_mqa`) and caches the first of the two until the second arrives, but only
  within one `load_weights` call, i.e. one `update_weights_from_tensor` bucket: a pair split over
  two buckets would never be loaded. So a tensor of such a pair (weight or FP8 scale) waits for
  its partner and goes into the partner's bucket. (GLM-4.5's q/k/v load separately.)
- Block FP8 (`quantized`): an engine started from a block-FP8 checkpoint (DeepSeek-V3, Kimi-K2 as
  released: `<name>` float8_e4m3fn + `<name>_scale_inv`) holds FP8 parameters, and SGLang's
  `update_weights_from_tensor` only runs the model's `load_weights`, which copies what it gets:
  every tensor the checkpoint stores quantized is sent quantized
  (`megarl.weights.fp8_blocks.quantize`) with its scale, under the checkpoint's names.
- The router's selection bias (`mlp.gate.e_score_correction_bias`) arrives in float32 (the weight
  stream keeps it so) and SGLang's loaders copy it into their float32 parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch

from megarl.weights.fp8_blocks import FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX, block_size, quantized_stream
from megarl.weights.hf_reader import HFCheckpoint, read_config

Bucket = list[tuple[str, torch.Tensor]]
FUSED_PAIRS = ((".self_attn.q_a_proj.", ".self_attn.kv_a_proj_with_mqa."),)


def partner(name: str) -> str | None:
    """The name SGLang loads fused with `name` (same suffix: weight with weight, scale with scale)."""
    for a, b in FUSED_PAIRS:
        if a in name:
            return name.replace(a, b)
        if b in name:
            return name.replace(b, a)
    return None


def keep_partners_together(buckets: Iterable[Bucket]) -> Iterator[Bucket]:
    """The same tensors in the same order, except that a fused pair's first tensor waits (a copy)
    for its partner's bucket. A stream that ends with a tensor still waiting is an error."""
    held: dict[str, tuple[str, torch.Tensor]] = {}
    for bucket in buckets:
        names = {n for n, _ in bucket}
        out: Bucket = []
        for name, t in bucket:
            other = partner(name)
            if other is None or other in names:
                out.append((name, t))
            elif other in held:
                out += [held.pop(other), (name, t)]
            else:
                held[name] = (name, t.clone())
        if out:
            yield out
    if held:
        raise RuntimeError(f"weight stream to SGLang: {sorted(held)} arrived without the tensors SGLang fuses them "
                           f"with ({[partner(n) for n in sorted(held)]})")


def fp8_engine_checkpoint(hf_path: str | Path, out: str | Path) -> Path:
    """A folder SGLang starts from to serve block-FP8 weights streamed in (rollout.weights_dtype=fp8):
    the model's config.json with `quantization_config` = FP8_QUANTIZATION_CONFIG and its other
    small files (tokenizer, generation and processor configs), no weights (start it with
    load_format="dummy"; the first weight sync fills them)."""
    import json
    import shutil

    src, out = Path(hf_path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja", ".tiktoken") and "index" not in f.name:
            shutil.copy2(f, out / f.name)
    config = read_config(src)
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def fp8_names(model_path: str | Path) -> tuple[set[str], tuple[int, int]] | None:
    """(names stored block-FP8, block) of the engine's checkpoint; None for a bf16 checkpoint. A
    folder without weights (`fp8_engine_checkpoint`: the stream sends them quantized) names none."""
    config = read_config(model_path)
    if ((config.get("quantization_config") or {}).get("quant_method")) != "fp8":
        return None
    if not any(Path(model_path).glob("*.safetensors")):
        return set(), block_size(config)
    names = {n[: -len(SCALE_SUFFIX)] for n in HFCheckpoint(model_path).names() if n.endswith(SCALE_SUFFIX)}
    return names, block_size(config)


def quantized(buckets: Iterable[Bucket], names: set[str], block: tuple[int, int]) -> Iterator[Bucket]:
    """Each bucket with the tensors in `names` replaced by their FP8 values and scales (a tensor
    that arrives in FP8 already, from a trainer with rollout.weights_dtype=fp8, passes)."""
    return quantized_stream(buckets, lambda n, t: n in names and t.dtype != torch.float8_e4m3fn, block)
