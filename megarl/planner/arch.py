"""The planner's inputs: the architecture read from an HF config.json (`Arch`), the GPUs it knows
(`GPUS`) and the memory a model keeps between phases (`ModelState`). See megarl/planner/__init__.py."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from megarl.config import ConfigError, MegaRLConfig
from megarl.planner.vision import VisionTower

REPO = Path(__file__).resolve().parents[2]  # configs/models/<model.name>.json

GIB = 1024**3
MOE_IMBALANCE = 2.0  # the busiest EP rank receives 2x the mean routed tokens (RL: no load-balancing loss)


@dataclass(frozen=True)
class GPU:
    name: str
    mem_bytes: int  # as nvidia-smi reports the total
    bf16_flops: float  # dense peak
    hbm_bytes_per_s: float


GPUS = {
    "h100": GPU("H100 SXM 80GB", 81559 * 1024**2, 989e12, 3.35e12),
    "h200": GPU("H200 SXM 141GB", 143771 * 1024**2, 989e12, 4.8e12),
}


# vision-language model_type -> the family of its language model (text_config)
VLM_TEXT_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}

def lm_config(hf: dict) -> dict:
    """The language model's fields of an HF config.json: a vision-language config keeps them in
    text_config (Qwen3-VL; transformers 5 saves) or at the top level (Qwen2.5-VL hub files);
    text_config wins, the top level fills the rest (vision_config, token ids)."""
    return {**hf, **(hf.get("text_config") or {})}


@dataclass(frozen=True)
class Arch:
    """Decoder architecture read from an HF config.json: dense, or MoE when num_experts > 0 (every
    layer's MLP = router + num_experts routed experts of moe_ffn, moe_topk per token, + an
    optional shared expert of shared_ffn with a sigmoid gate, as Qwen2-MoE); a vision-language
    config (qwen2_5_vl, qwen3_vl, qwen3_vl_moe) adds its vision tower (`VisionTower`) and keeps
    the LM's fields in text_config or at its top level (`lm_config`)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    vision: VisionTower | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> "Arch":
        model_type = hf.get("model_type", "")
        family = VLM_TEXT_FAMILY.get(model_type, model_type)
        if hf.get("vision_config") is not None and model_type not in VLM_TEXT_FAMILY:
            raise ConfigError(f"planner: vision-language model_type {model_type!r} is not modelled "
                              f"({', '.join(VLM_TEXT_FAMILY)} are)")
        t = lm_config(hf)
        if any(t.get(k) for k in ("num_local_experts", "n_routed_experts")) or (
                t.get("num_experts") and family not in ("qwen3_moe", "qwen2_moe")):
            raise ConfigError(f"planner: MoE model_type {model_type!r} is not modelled "
                              "(qwen3_moe, qwen2_moe and qwen3_vl_moe are)")
        heads = t["num_attention_heads"]
        experts = int(t.get("num_experts") or 0)
        # HF's Qwen2 attention (Qwen2.5-VL's LM too) ignores head_dim: hidden / heads
        head_dim = (None if family == "qwen2" else t.get("head_dim")) or t["hidden_size"] // heads
        tie = hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        return cls(
            hidden=t["hidden_size"],
            layers=t["num_hidden_layers"],
            heads=heads,
            kv_heads=t.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn=t["intermediate_size"],
            vocab=t["vocab_size"],
            tie_embeddings=bool(tie),
            qkv_bias=bool(t.get("attention_bias", family in ("qwen2", "qwen2_moe"))),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_topk=int(t.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(t.get("moe_intermediate_size") or 0) if experts else 0,
            shared_ffn=int(t.get("shared_expert_intermediate_size") or 0) if experts else 0,
            vision=VisionTower.from_hf(hf) if model_type in VLM_TEXT_FAMILY else None,
        )

    def _attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias)."""
        h, a, g, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        attn = h * a * d + 2 * h * g * d + a * d * h
        return attn + (a * d + 2 * g * d if self.qkv_bias else 0)

    def _replicated_layer_params(self) -> int:
        """Per layer, replicated over TP: two norms (2h), q/k norms (2d), MoE router (E*h) and
        shared expert gate (h)."""
        out = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.num_experts:
            out += self.num_experts * self.hidden + (self.hidden if self.shared_ffn else 0)
        return out

    def expert_layer_params(self) -> int:
        """Routed experts of one layer: E gated MLPs (gate, up, down) of moe_ffn, E * 3*h*f_e."""
        return self.num_experts * 3 * self.hidden * self.moe_ffn

    def layer_params(self) -> int:
        """Attention, norms and the MLP: gated (3*h*f) when dense; router, routed experts and the
        shared expert (3*h*f_s) when MoE."""
        mlp = 3 * self.hidden * (self.shared_ffn if self.num_experts else self.ffn)
        return self._attention_params() + mlp + self.expert_layer_params() + self._replicated_layer_params()

    def lm_params(self, value_head: bool = False) -> int:
        """The language model's parameters; a critic replaces the LM head with a scalar value head (h + 1)."""
        emb = self.vocab * self.hidden
        head = (self.hidden + 1) if value_head else (0 if self.tie_embeddings else emb)
        return emb + self.layers * self.layer_params() + self.hidden + head

    def total_params(self, value_head: bool = False) -> int:
        """All parameters: the language model and the vision tower (a vision-language critic keeps it)."""
        return self.lm_params(value_head) + (self.vision.total_params() if self.vision else 0)

    def active_params(self, value_head: bool = False) -> int:
        """Parameters one LM token passes through: the language model's less the routed experts it
        is not sent to, layers * (E - k) * 3*h*f_e (= lm_params for a dense model); the tower's
        work is per patch (VisionTower.forward_flops)."""
        idle = self.layers * (self.num_experts - self.moe_topk) * 3 * self.hidden * self.moe_ffn
        return self.lm_params(value_head) - idle

    def stage_expert_params(self, pp: int, ep: int = 1, etp: int = 1) -> int:
        """Routed-expert parameters on one GPU: layers_per_stage * E * 3*h*f_e / (EP * ETP)."""
        return math.ceil(self.layers / pp) * self.expert_layer_params() // (ep * etp)

    def stage_vision_params(self, tp: int) -> int:
        """Vision-tower parameters on one GPU of the first stage (0 for a text model)."""
        return int(math.ceil(self.vision.stage_params(tp))) if self.vision else 0

    def stage_params(self, tp: int, pp: int, value_head: bool = False, ep: int = 1, etp: int | None = None,
                     vision: bool = True) -> int:
        """Parameters on one GPU of the largest pipeline stage (TP-sharded; norms, router
        replicated; routed experts over EP x ETP, ETP = etp or tp; the vision tower on the first
        stage, `VisionTower.stage_params`, unless vision=False: a frozen tower's untrained part)."""
        layers_per_stage = math.ceil(self.layers / pp)
        replicated = self._replicated_layer_params()
        sharded_layer = (self.layer_params() - replicated - self.expert_layer_params()) / tp
        per_layer = sharded_layer + replicated
        emb = self.vocab * self.hidden / tp
        head = (self.hidden + 1) if value_head else (emb if (not self.tie_embeddings or pp > 1) else 0)
        first = (emb + (self.stage_vision_params(tp) if vision else 0) + layers_per_stage * per_layer
                 + (head + self.hidden if pp == 1 else 0))
        last = layers_per_stage * per_layer + self.hidden + head + (emb if pp == 1 else 0)
        dense = int(math.ceil(max(first, last) if pp > 1 else first))
        return dense + self.stage_expert_params(pp, ep, etp or tp)

    def kv_bytes_per_token(self, rollout_tp: int) -> float:
        """KV cache per token on one engine GPU: 2 (K, V) * layers * kv_heads * head_dim * 2 bytes
        / rollout_tp (KV heads are replicated when rollout_tp > kv_heads)."""
        heads_per_gpu = self.kv_heads / rollout_tp if self.kv_heads >= rollout_tp else 1
        return 2 * self.layers * heads_per_gpu * self.head_dim * 2


def load_arch(cfg: MegaRLConfig, model_json: str | None = None) -> tuple[Arch, dict, str]:
    """The HF config: --model-json, else hf_path/config.json, else configs/models/<model.name>.json."""
    candidates = [model_json] if model_json else []
    if cfg.model.hf_path:
        candidates.append(os.path.join(cfg.model.hf_path, "config.json"))
    if cfg.model.name:
        candidates.append(str(REPO / "configs" / "models" / f"{cfg.model.name}.json"))
    for path in candidates:
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
            return Arch.from_hf(hf), hf, path
    raise ConfigError(f"planner: no model config found (tried {candidates or 'nothing'}); pass --model-json "
                      "or set model.name / model.hf_path")


# ----------------------------------------------------------------------------- memory


@dataclass
class ModelState:
    role: str
    params_gpu: int
    weights: float
    grads: float
    optimizer: float
    offload_optimizer: bool

    @property
    def resident(self) -> float:
        """Bytes on the GPU during forward / backward."""
        return self.weights + self.grads + (0.0 if self.offload_optimizer else self.optimizer)

    @property
    def at_step(self) -> float:
        return self.weights + self.grads + self.optimizer

