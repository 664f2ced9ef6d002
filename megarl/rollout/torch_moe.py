"""Sparse mixture-of-experts MLP of the builtin engine (HF Qwen3-MoE / Qwen2-MoE numerics).

Routing, as transformers 5.19 `Qwen2MoeTopKRouter` / `Qwen3MoeTopKRouter`:
    p = softmax(x W_gate^T) in fp32;  (w, e) = top-k(p);  w /= sum(w) when norm_topk_prob;
    y = sum_j w_j * expert_{e_j}(x)  [+ sigmoid(x . g) * shared_expert(x) for Qwen2-MoE],
with expert(x) = down(silu(gate(x)) * up(x)). Attribute names mirror HF checkpoint names
(`mlp.gate.weight`, `mlp.experts.3.up_proj.weight`, `mlp.shared_expert_gate.weight`).

`routing_log`: when a list is set on the module, every forward appends the selected experts
[tokens, k] (int, sorted ascending) of its input tokens, row-major over [batch, time].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, topk: int, expert_ffn: int, norm_topk_prob: bool,
                 shared_expert_ffn: int = 0):
        super().__init__()
        self.topk, self.norm_topk_prob = topk, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, expert_ffn) for _ in range(num_experts))
        if shared_expert_ffn:
            self.shared_expert = ExpertMLP(hidden, shared_expert_ffn)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.routing_log: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        if self.routing_log is not None:
            self.routing_log.append(experts.sort(dim=-1).values)
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](h[rows]) * weights[rows, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.view(shape)


class RoutingTape:
    """Collects the experts every MoE block of `model` selects, one forward at a time:
    `take()` -> [tokens, layers, k] int16 of the last forward (tokens row-major over [batch, time]).
    A model whose first layers are dense (DeepSeek-V3, GLM-4.5: `model.model.layers[i].mlp` not a
    SparseMoE) gets experts 0..k-1 in their rows, as every layer has a row (SGLang's layout too);
    nothing reads them (only MoE layers replay)."""

    def __init__(self, model: nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        layers = getattr(getattr(model, "model", None), "layers", None)
        self.is_moe = ([isinstance(getattr(layer, "mlp", None), SparseMoE) for layer in layers]
                       if layers is not None else [True] * len(self.blocks))
        if sum(self.is_moe) != len(self.blocks):
            self.is_moe = [True] * len(self.blocks)
        for b in self.blocks:
            b.routing_log = []

    def take(self) -> torch.Tensor:
        moe = []
        for b in self.blocks:
            if len(b.routing_log) != 1:
                raise RuntimeError(f"routing tape: expected one forward per take, got {len(b.routing_log)}")
            moe.append(b.routing_log.pop())
        filler = torch.arange(moe[0].shape[1], device=moe[0].device).expand(moe[0].shape[0], -1)
        logged = iter(moe)
        per_layer = [next(logged) if is_moe else filler for is_moe in self.is_moe]
        return torch.stack(per_layer, dim=1).to(torch.int16).cpu()

    def close(self) -> None:
        for b in self.blocks:
            b.routing_log = None


def sample_routing(context: torch.Tensor, generated: list[torch.Tensor], total: int) -> torch.Tensor:
    """[total, layers, k] routing of a sample: the context's (prefill), then the generated tokens'
    (decode). The engine never forwards a sample's last token (nothing is sampled after it); its
    rows, and any other token not forwarded, get experts 0..k-1: valid and distinct, and read by
    nothing the loss uses (a token's routing affects only its own and later positions)."""
    layers, k = context.shape[1], context.shape[2]
    out = torch.arange(k, dtype=torch.int16).expand(total, layers, k).clone()
    rec = torch.cat([context] + [g[None] for g in generated]) if generated else context
    n = min(total, rec.shape[0])
    out[:n] = rec[:n]
    return out
