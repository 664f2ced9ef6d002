"""The planner's inputs: the architecture read from an HF config.json (`Arch`), the GPUs it knows
(`GPUS`) and the memory a model keeps between phases (`ModelState`). See megarl/planner/__init__.py."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from megarl.config import ConfigError, MegaRLConfig
from megarl.planner.hybrid import GDNShape
from megarl.planner.mla import MLAShape, engine_weight_bytes, fp8_checkpoint
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
VLM_TEXT_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
                   "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# hybrid gated delta-net families (megarl/planner/hybrid.py): q/k norms, a gate per query head
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
SOFTMAX_MOE = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
# sigmoid-routed MoE families (megarl.models.deepseek): n_routed_experts, n_shared_experts ungated
# experts of moe_intermediate_size, the first first_k_dense_replace layers dense
SIGMOID_MOE = ("deepseek_v3", "kimi_k2", "glm4_moe")

def lm_config(hf: dict) -> dict:
    """The language model's fields of an HF config.json: a vision-language config keeps them in
    text_config (Qwen3-VL; transformers 5 saves) or at the top level (Qwen2.5-VL hub files);
    text_config wins, the top level fills the rest (vision_config, token ids)."""
    return {**hf, **(hf.get("text_config") or {})}


@dataclass(frozen=True)
class Arch:
    """Decoder architecture read from an HF config.json: dense, or MoE when num_experts > 0 (every
    layer's MLP = router + num_experts routed experts of moe_ffn, moe_topk per token, + an
    optional shared expert of shared_ffn with a sigmoid gate, as Qwen2-MoE); DeepSeek-V3 /
    Kimi-K2 / GLM-4.5 (SIGMOID_MOE): the first dense_layers layers have a dense MLP of ffn, the
    shared expert has no gate, DeepSeek's attention is multi-latent (`mla`, megarl/planner/mla.py);
    fp8: the checkpoint's weights are block-FP8 (what the rollout engine holds); a vision-language
    config (qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe) adds its vision tower
    (`VisionTower`) and keeps the LM's fields in text_config or at its top level (`lm_config`);
    hybrid models (qwen3_next, qwen3_5, qwen3_5_moe) have gated delta-net layers (`gdn`,
    megarl/planner/hybrid.py)."""

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
    dense_layers: int = 0
    shared_gate: bool = True
    mla: MLAShape | None = None
    fp8: bool = False
    gdn: GDNShape | None = None  # hybrid models: the gated delta-net layers (megarl/planner/hybrid.py)

    @classmethod
    def from_hf(cls, hf: dict) -> "Arch":
        model_type = hf.get("model_type", "")
        family = VLM_TEXT_FAMILY.get(model_type, model_type)
        if hf.get("vision_config") is not None and model_type not in VLM_TEXT_FAMILY:
            raise ConfigError(f"planner: vision-language model_type {model_type!r} is not modelled "
                              f"({', '.join(VLM_TEXT_FAMILY)} are)")
        t = lm_config(hf)
        if family in SIGMOID_MOE:
            return cls._sigmoid_moe(hf, t)
        if any(t.get(k) for k in ("num_local_experts", "n_routed_experts")) or (
                t.get("num_experts") and family not in SOFTMAX_MOE):
            raise ConfigError(f"planner: MoE model_type {model_type!r} is not modelled "
                              f"(qwen3_moe, qwen2_moe, qwen3_vl_moe, qwen3_next, qwen3_5_moe and "
                              f"{', '.join(SIGMOID_MOE)} are)")
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
            ffn=int(t.get("intermediate_size") or 0),  # Qwen3.5-MoE has no dense MLP
            vocab=t["vocab_size"],
            tie_embeddings=bool(tie),
            qkv_bias=bool(t.get("attention_bias", family in ("qwen2", "qwen2_moe"))),
            qk_norm=family in ("qwen3", "qwen3_moe", *HYBRID),
            num_experts=experts,
            moe_topk=int(t.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(t.get("moe_intermediate_size") or 0) if experts else 0,
            shared_ffn=int(t.get("shared_expert_intermediate_size") or 0) if experts else 0,
            vision=VisionTower.from_hf(hf) if model_type in VLM_TEXT_FAMILY else None,
            gdn=GDNShape.from_hf(t) if family in HYBRID else None, fp8=fp8_checkpoint(hf),
        )

    @classmethod
    def _sigmoid_moe(cls, hf: dict, t: dict) -> "Arch":
        """DeepSeek-V3 / Kimi-K2 (multi-latent attention) and GLM-4.5 (GQA, q/k/v bias, q/k norms
        with use_qk_norm)."""
        heads, mla = t["num_attention_heads"], MLAShape.from_hf(t)
        moe = int(t["moe_intermediate_size"])
        return cls(
            hidden=t["hidden_size"], layers=t["num_hidden_layers"], heads=heads,
            kv_heads=heads if mla else (t.get("num_key_value_heads") or heads),
            head_dim=mla.qd if mla else (t.get("head_dim") or t["hidden_size"] // heads), ffn=t["intermediate_size"],
            vocab=t["vocab_size"], tie_embeddings=bool(t.get("tie_word_embeddings", False)),
            qkv_bias=bool(t.get("attention_bias")) and not mla, qk_norm=bool(t.get("use_qk_norm")) and not mla,
            num_experts=int(t["n_routed_experts"]), moe_topk=int(t["num_experts_per_tok"]), moe_ffn=moe,
            shared_ffn=moe * int(t.get("n_shared_experts") or 0),
            dense_layers=min(int(t.get("first_k_dense_replace") or 0), t["num_hidden_layers"]),
            shared_gate=False, mla=mla, fp8=fp8_checkpoint(hf))

    @property
    def value_dim(self) -> int:
        """Width of each head's value (multi-latent attention's v_head_dim; head_dim otherwise)."""
        return self.mla.v if self.mla is not None else self.head_dim

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention (a hybrid model's other layers are gated delta-nets)."""
        return self.layers - (self.gdn.layers if self.gdn is not None else 0)

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (all, or all but the first dense_layers)."""
        return self.layers - self.dense_layers if self.num_experts else 0

    def stage_layers(self, pp: int, stage: int) -> tuple[int, int]:
        """(dense, MoE) layers of pipeline stage `stage` (ceil(layers / pp) per stage; the dense
        layers are the model's first)."""
        per = math.ceil(self.layers / pp)
        lo, hi = stage * per, min(self.layers, (stage + 1) * per)
        dense = max(0, min(hi, self.dense_layers if self.num_experts else self.layers) - lo)
        return dense, max(0, hi - lo - dense)

    def _attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias); TP-sharded part of multi-latent attention."""
        if self.mla is not None:
            return self.mla.sharded_params(self.hidden, self.heads)
        h, a, g, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        attn = h * a * d + 2 * h * g * d + a * d * h
        attn += a * d + 2 * g * d if self.qkv_bias else 0
        if self.gdn is None:
            return attn
        # hybrid: the mean over the layers (within a parameter per layer) of gated attention (q_proj
        # 2*a*d wide) and gated delta-net layers (megarl/planner/hybrid.py)
        total = self.attention_layers * (attn + h * a * d) + self.gdn.layers * self.gdn.sharded_params(h)
        return round(total / self.layers)

    def _replicated_layer_params(self, moe: bool = True) -> int:
        """Per layer, replicated over TP: two norms (2h), q/k norms (2d), multi-latent attention's
        down projections and latent norms, and in an MoE layer the router (E*h; E more for a
        sigmoid router's selection bias) and a shared expert gate (h)."""
        out = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.gdn is not None:  # q/k norms in the attention layers, the gated norm (d_v) in the others
            out += round((self.gdn.layers * (self.gdn.value_dim - 2 * self.head_dim)) / self.layers)
        if self.mla is not None:
            out += self.mla.replicated_params(self.hidden)
        if self.num_experts and moe:
            out += self.num_experts * self.hidden + (self.hidden if self.shared_ffn and self.shared_gate else 0)
            out += 0 if self.shared_gate else self.num_experts
        return out

    def expert_layer_params(self) -> int:
        """Routed experts of one layer: E gated MLPs (gate, up, down) of moe_ffn, E * 3*h*f_e."""
        return self.num_experts * 3 * self.hidden * self.moe_ffn

    def layer_params(self, moe: bool = True) -> int:
        """Attention, norms and the MLP: gated (3*h*f) when dense (moe=False: a dense layer of an
        MoE model); router, routed experts and the shared expert (3*h*f_s) when MoE."""
        moe = moe and bool(self.num_experts)
        mlp = 3 * self.hidden * (self.shared_ffn if moe else self.ffn)
        return (self._attention_params() + mlp + (self.expert_layer_params() if moe else 0)
                + self._replicated_layer_params(moe))

    def lm_params(self, value_head: bool = False) -> int:
        """The language model's parameters; a critic replaces the LM head with a scalar value head (h + 1)."""
        emb = self.vocab * self.hidden
        head = (self.hidden + 1) if value_head else (0 if self.tie_embeddings else emb)
        dense = self.layers - self.moe_layers
        return emb + self.moe_layers * self.layer_params() + dense * self.layer_params(False) + self.hidden + head

    def total_params(self, value_head: bool = False) -> int:
        """All parameters: the language model and the vision tower (a vision-language critic keeps it)."""
        return self.lm_params(value_head) + (self.vision.total_params() if self.vision else 0)

    def active_params(self, value_head: bool = False) -> int:
        """Parameters one LM token passes through: the language model's less the routed experts it
        is not sent to, layers * (E - k) * 3*h*f_e (= lm_params for a dense model); the tower's
        work is per patch (VisionTower.forward_flops)."""
        idle = self.moe_layers * (self.num_experts - self.moe_topk) * 3 * self.hidden * self.moe_ffn
        return self.lm_params(value_head) - idle

    def stage_expert_params(self, pp: int, ep: int = 1, etp: int = 1) -> int:
        """Routed-expert parameters on one GPU of the stage with the most MoE layers (the last):
        moe_layers_per_stage * E * 3*h*f_e / (EP * ETP)."""
        return self.stage_layers(pp, pp - 1)[1] * self.expert_layer_params() // (ep * etp)

    def stage_vision_params(self, tp: int) -> int:
        """Vision-tower parameters on one GPU of the first stage (0 for a text model)."""
        return int(math.ceil(self.vision.stage_params(tp))) if self.vision else 0

    def stage_params(self, tp: int, pp: int, value_head: bool = False, ep: int = 1, etp: int | None = None,
                     vision: bool = True) -> int:
        """Parameters on one GPU of the largest pipeline stage (TP-sharded; norms, router
        replicated; routed experts over EP x ETP, ETP = etp or tp; the vision tower on the first
        stage, `VisionTower.stage_params`, unless vision=False: a frozen tower's untrained part)."""
        def per_layer(moe: bool) -> float:
            replicated = self._replicated_layer_params(moe)
            experts = self.expert_layer_params() if moe and self.num_experts else 0
            return (self.layer_params(moe) - replicated - experts) / tp + replicated

        def stage_layers(stage: int) -> float:
            dense, moe = self.stage_layers(pp, stage)
            return dense * per_layer(False) + moe * per_layer(True)

        emb = self.vocab * self.hidden / tp
        head = (self.hidden + 1) if value_head else (emb if (not self.tie_embeddings or pp > 1) else 0)
        first = (emb + (self.stage_vision_params(tp) if vision else 0) + stage_layers(0)
                 + (head + self.hidden if pp == 1 else 0))
        last = stage_layers(pp - 1) + self.hidden + head + (emb if pp == 1 else 0)
        dense = int(math.ceil(max(first, last) if pp > 1 else first))
        return dense + self.stage_expert_params(pp, ep, etp or tp)

    def kv_bytes_per_token(self, rollout_tp: int) -> float:
        """KV cache per token on one engine GPU: 2 (K, V) * layers * kv_heads * head_dim * 2 bytes
        / rollout_tp (KV heads are replicated when rollout_tp > kv_heads); multi-latent attention:
        the latent, 2 * layers * (kv_lora + rope) bytes on every GPU of the engine."""
        if self.mla is not None:
            return self.mla.kv_bytes_per_token(self.layers)
        heads_per_gpu = self.kv_heads / rollout_tp if self.kv_heads >= rollout_tp else 1
        return 2 * self.attention_layers * heads_per_gpu * self.head_dim * 2  # a hybrid's attention layers only

    def state_bytes_per_sequence(self, rollout_tp: int) -> float:
        """A hybrid model's recurrent and conv states of one sequence on one engine GPU (constant in
        its length; megarl/planner/hybrid.py); 0 for the other families."""
        return self.gdn.state_bytes_per_sequence(rollout_tp) if self.gdn is not None else 0.0

    def state_tokens(self, rollout_tp: int) -> float:
        """That state in tokens of KV cache: what each sequence costs the engine's pool besides its tokens."""
        return self.state_bytes_per_sequence(rollout_tp) / self.kv_bytes_per_token(rollout_tp)

    def engine_weight_bytes(self, rollout_tp: int, lm_only: bool = False, fp8: bool = False) -> float:
        """The rollout engine's weights on one GPU: 2 bytes per parameter / rollout_tp, or with a
        block-FP8 checkpoint (or fp8: rollout.weights_dtype=fp8) 1 byte (+ block scales) per
        parameter but the embeddings' (megarl/planner/mla.py); lm_only: without the vision tower."""
        total = self.lm_params() if lm_only else self.total_params()
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return engine_weight_bytes(total, emb, self.fp8 or fp8) / rollout_tp


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
        """Bytes on the GPU during this model's optimizer step. With offload_optimizer the Adam state
        and the fp32 master weights live on the host and the step runs there (megatron's
        HybridDeviceOptimizer at offload fraction 1: the gradients go to pinned host buffers)."""
        return self.weights + self.grads + (0.0 if self.offload_optimizer else self.optimizer)

