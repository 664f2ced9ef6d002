"""What the planner needs to know about the hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE:
megarl.models.hybrid): the gated delta-net layers' parameters, activations and recurrent state,
and the gated full-attention layers.

A model of L layers has L_g delta-net layers (config `layer_types` "linear_attention") and
L_a = L - L_g full-attention layers. With h hidden, n_k key heads of d_k, n_v value heads of d_v,
conv kernel K, C = 2 n_k d_k + n_v d_v (the convolved q | k | v channels):
  parameters   per delta-net layer, TP-sharded: in_proj h x (C + n_v d_v + 2 n_v), conv C x K,
               A_log and dt_bias 2 n_v, out_proj n_v d_v x h; replicated: the gated norm d_v.
               A full-attention layer's q_proj holds a gate per query head: h x 2 a d (not a d).
               The planner's per-layer terms are the mean over the layers (3/4 delta-net in the
               released models), exact in the totals.
  KV cache     only the L_a attention layers cache K / V per token; per sequence and engine GPU,
               every delta-net layer keeps its recurrent state n_v/tp x d_k x d_v in float32
               (SGLang's `mamba_ssm_dtype`, HF and flash-linear-attention keep it so) and the
               convolution's last K-1 inputs C/tp x (K-1) in bf16: S = L_g * (4 n_v d_k d_v +
               2 C (K-1)) / tp bytes, whatever the length. The planner counts S as S / kv_per_token
               tokens of every sequence (`state_tokens`), and the decode step reads and writes it.
  activations  per token and delta-net layer (bf16, TP-sharded; replaces the attention terms
               4 a d + 4 g d + core attention): the projections' output 2 (C + n_v d_v + 2 n_v),
               the convolved q | k | v 2 C, the gated norm's input and output 4 n_v d_v, and the
               chunk kernel's per-chunk states (flash-linear-attention keeps one n_v x d_k x d_v
               float32 state per 64-token chunk): 4 n_v d_k d_v / 64.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64  # flash-linear-attention's chunk of the gated delta rule


@dataclass(frozen=True)
class GDNShape:
    layers: int  # L_g, delta-net layers
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def from_hf(cls, t: dict) -> "GDNShape | None":
        """From an LM config (text_config fields); None without linear-attention layers."""
        kinds = t.get("layer_types")
        if kinds is None and t.get("linear_num_value_heads") is not None:  # the config's own default pattern
            every = int(t.get("full_attention_interval") or 4)
            kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(t["num_hidden_layers"])]
        linear = sum(k == "linear_attention" for k in kinds or ())
        if not linear:
            return None
        return cls(linear, int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"]),
                   int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"]), int(t.get("linear_conv_kernel_dim") or 4))

    @property
    def conv_channels(self) -> int:
        """C = 2 n_k d_k + n_v d_v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def sharded_params(self, h: int) -> int:
        """One delta-net layer's TP-sharded parameters (module doc)."""
        v = self.value_heads * self.value_dim
        return h * (self.conv_channels + v + 2 * self.value_heads) + self.conv_channels * self.conv_kernel \
            + 2 * self.value_heads + v * h

    def state_bytes_per_sequence(self, tp: int) -> float:
        """S of the module doc: recurrent (float32) and conv (bf16) state of one sequence on one engine GPU."""
        state = 4.0 * self.value_heads * self.key_dim * self.value_dim
        conv = 2.0 * self.conv_channels * (self.conv_kernel - 1)
        return self.layers * (state + conv) / tp

    def activation_bytes(self) -> float:
        """Bytes per token and delta-net layer, before TP sharding (module doc)."""
        v = self.value_heads * self.value_dim
        return 2.0 * (self.conv_channels + v + 2 * self.value_heads) + 2.0 * self.conv_channels + 4.0 * v \
            + 4.0 * self.value_heads * self.key_dim * self.value_dim / CHUNK
