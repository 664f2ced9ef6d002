"""megarl.models: HF config -> megatron-core GPTModel (family registry, bridges, value head)."""

from megarl.models.builder import build_model, padded_vocab_size, transformer_config, unwrap
from megarl.models.families import (
    ArchSpec, UnsupportedModelError, arch_spec, register_family, supported_model_types)
from megarl.models.forward import megatron_forward_logits
from megarl.models import vision as _vision  # noqa: F401,E402  (registers the vision-language families)
from megarl.models import deepseek as _deepseek  # noqa: F401,E402  (deepseek_v3, kimi_k2, glm4_moe)
from megarl.models import hybrid as _hybrid  # noqa: F401,E402  (qwen3_next, qwen3_5, qwen3_5_moe)
from megarl.models import hybrid_bridge as _hybrid_bridge  # noqa: F401,E402  (their HF naming)

__all__ = [
    "ArchSpec", "UnsupportedModelError", "arch_spec", "build_model", "megatron_forward_logits",
    "padded_vocab_size", "register_family", "supported_model_types", "transformer_config", "unwrap",
]
