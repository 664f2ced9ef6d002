"""What the planner needs to know about DeepSeek-V3 / Kimi-K2 (multi-latent attention) and GLM-4.5:
the attention's parameters, activations and KV cache, and the FP8 engine weights.

Multi-latent attention (megarl.models.mla), h hidden, H heads, q_lora / kv_lora the latent ranks,
n / r the nope / rope head dims (qd = n + r) and v the value head dim:
  parameters   TP-sharded: q_b (q_lora x H*qd) or q (h x H*qd), kv_b (kv_lora x H*(n + v)), o (H*v x h);
               replicated (Transformer Engine's duplicated down projections, the latent norms):
               q_a (h x q_lora) + q_lora, kv_a (h x (kv_lora + r)) + kv_lora.
  activations  per token and layer, bf16: Q and K expanded per head 4*H*qd, V and the attention
               output 4*H*v (TP-sharded, the S term of megarl/planner/activations.py); the latents
               the up projections and their norms keep, 4*q_lora + 4*(kv_lora + r) (replicated,
               the R term).
  KV cache     SGLang caches the latent, (kv_lora + r) per token and layer in bf16, the same on every
               TP rank of an engine (it is shared by all heads): 2 * layers * (kv_lora + r) bytes per
               token and GPU, against 2 * 2 * layers * H * ... for expanded K / V.
FP8 engine weights: an engine started from a block-FP8 checkpoint (config.json quantization_config
with quant_method fp8, as DeepSeek-V3 / Kimi-K2 ship) holds every quantized linear weight in one
byte plus a float32 scale per 128 x 128 block; embeddings, norms and routers stay bf16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAShape:
    q_lora: int  # 0: no query latent
    kv_lora: int
    nope: int
    rope: int
    v: int

    @classmethod
    def from_hf(cls, t: dict) -> "MLAShape | None":
        if t.get("kv_lora_rank") is None:
            return None
        return cls(int(t.get("q_lora_rank") or 0), int(t["kv_lora_rank"]), int(t["qk_nope_head_dim"]),
                   int(t["qk_rope_head_dim"]), int(t["v_head_dim"]))

    @property
    def qd(self) -> int:
        return self.nope + self.rope

    def sharded_params(self, h: int, heads: int) -> int:
        q = self.q_lora * heads * self.qd if self.q_lora else h * heads * self.qd
        return q + self.kv_lora * heads * (self.nope + self.v) + heads * self.v * h

    def replicated_params(self, h: int) -> int:
        q = h * self.q_lora + self.q_lora if self.q_lora else 0
        return q + h * (self.kv_lora + self.rope) + self.kv_lora

    def activation_bytes(self, heads: int) -> tuple[float, float]:
        """(replicated, TP-sharded) bytes per token and layer (module doc)."""
        return 4.0 * self.q_lora + 4.0 * (self.kv_lora + self.rope), 4.0 * heads * self.qd + 4.0 * heads * self.v

    def kv_bytes_per_token(self, layers: int) -> float:
        return 2.0 * layers * (self.kv_lora + self.rope)


def fp8_checkpoint(hf: dict) -> bool:
    """Whether config.json describes block-FP8 weights (DeepSeek-V3's released format)."""
    q = hf.get("quantization_config") or {}
    return q.get("quant_method") == "fp8"


def engine_weight_bytes(total_params: int, embedding_params: int, fp8: bool) -> float:
    """Engine weight bytes of the whole model: 2 per parameter in bf16; with FP8 weights 1 per
    quantized parameter plus 4 bytes per 128 x 128 block, the embeddings (input and output) in bf16."""
    if not fp8:
        return 2.0 * total_params
    quantized = total_params - embedding_params
    return quantized * (1.0 + 4.0 / (128 * 128)) + 2.0 * embedding_params
