"""Vision-language models on megatron-core: Qwen2.5-VL (`qwen2_5_vl`), Qwen3-VL (`qwen3_vl`) and
Qwen3-VL-MoE (`qwen3_vl_moe`).

- `spec`, `qwen3_vl_spec`: the family registrations (`ArchSpec.vision` = `VisionSpec` /
  `Qwen3VisionSpec`, `ArchSpec.mrope_section`);
- `geometry`, `qwen3_vl_geometry`, `mrope`: pure index arithmetic (patch order, windows, 2D RoPE,
  position-table interpolation, M-RoPE position ids and interleaved frequency axes);
- `tower`, `qwen3_vl_tower`: the vision towers on megatron modules; `model`: `Qwen2_5_VLModel`
  (GPTModel + tower), `qwen3_vl_model`: `Qwen3VLMoeModel` (+ interleaved M-RoPE, DeepStack; dense or
  MoE LM);
- `bridge`, `qwen3_vl_bridge`: HF names and TP / expert layouts; `forward`: logits of images + text
  at any TP/PP/EP.
"""

from megarl.models.vision import qwen3_vl_spec as _qwen3_vl_spec  # noqa: F401  (registers "qwen3_vl", "qwen3_vl_moe")
from megarl.models.vision import spec as _spec  # noqa: F401  (registers model_type "qwen2_5_vl")
from megarl.models.vision.qwen3_vl_spec import Qwen3VisionSpec
from megarl.models.vision.spec import VisionSpec

__all__ = ["Qwen3VisionSpec", "VisionSpec", "model_class"]


def model_class(spec):
    """The megatron model class of a vision-language `ArchSpec` (built as cls(arch_spec=spec, **GPTModel kwargs))."""
    if spec.model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        from megarl.models.vision.qwen3_vl_model import Qwen3VLMoeModel

        return Qwen3VLMoeModel
    from megarl.models.vision.model import Qwen2_5_VLModel

    return Qwen2_5_VLModel
