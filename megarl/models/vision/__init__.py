"""Vision-language models on megatron-core: Qwen2.5-VL (`qwen2_5_vl`).

- `spec`: the family registration (`ArchSpec.vision` = `VisionSpec`, `ArchSpec.mrope_section`);
- `geometry`, `mrope`: pure index arithmetic (patch order, windows, 2D RoPE, M-RoPE position ids);
- `tower`: the vision tower on megatron modules; `model`: `Qwen2_5_VLModel` (GPTModel + tower);
- `bridge`: HF `visual.*` names and TP layouts; `forward`: logits of images + text at any TP/PP.
"""

from megarl.models.vision import spec as _spec  # noqa: F401  (registers model_type "qwen2_5_vl")
from megarl.models.vision.spec import VisionSpec

__all__ = ["VisionSpec"]
