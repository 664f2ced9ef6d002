"""RMSNorm for megarl's local layer spec that also runs under sequence parallelism.

megatron's local spec falls back to `WrappedTorchNorm` (torch.nn.RMSNorm) without apex, which
refuses `sequence_parallel`. This one computes the same thing,
    y = x / sqrt(mean(x^2, last dim) + eps) * weight   (torch.nn.functional.rms_norm),
or with `layernorm_zero_centered_gamma` (Qwen3-Next, Qwen3.5) * (1 + weight), in float32,
and, like megatron's fused norms, tags its weight `sequence_parallel` when the config asks for it:
each TP rank then holds a slice of the sequence, so its weight gradient is a partial sum that
megatron's `finalize_model_grads` all-reduces (sums) over the TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """Signature of megatron's norm modules (`build_module(spec, config=, hidden_size=, eps=)`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        if normalization != "RMSNorm" or config.normalization != "RMSNorm":
            raise ValueError("megarl.models.norm.RMSNorm implements RMSNorm only")
        self.eps = eps
        self.zero_centered = bool(config.layernorm_zero_centered_gamma or zero_centered_gamma)
        # params_dtype like every other weight (megatron's Float16Module casts WrappedTorchNorm's the
        # same way): an fp32 weight under bf16 activations keeps torch.rms_norm off its fused kernel
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # normalised and scaled in float32, as HF's Qwen3NextRMSNorm
            y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())
            return y.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
