"""megarl.models.norm.RMSNorm: the formula, and its weight in the model's parameter dtype."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megarl.models.norm import RMSNorm


def _config(dtype):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                             params_dtype=dtype, bf16=dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_follows_params_dtype_and_output_is_the_formula(dtype):
    norm = RMSNorm(_config(dtype), hidden_size=8, eps=1e-6)
    assert norm.weight.dtype == dtype  # an fp32 weight under bf16 inputs misses the fused kernel
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 2.0, 8).double()
    y = norm(x.to(dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
