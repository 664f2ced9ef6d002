"""Token log-probs and entropy on vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the vocabulary. Both quantities need only
three TP all-reduces of [tokens]-sized tensors (max, sum-exp, and the target logit / expected
logit), never the full [tokens, V] matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] over the full (TP-sharded) vocabulary.

    logits: [..., V/tp] (this rank's vocab slice), targets: [...] global token ids.
    Differentiable: megatron's vocab_parallel_cross_entropy (which returns -log p) carries the
    gradient across the TP group correctly; at TP = 1 torch's fused cross entropy computes the same
    -log p in fewer passes over the [tokens, V] logits. The input is copied to float32 (divided by
    T unless T = 1) first, which also keeps megatron's in-place max subtraction off the caller's
    logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if _tp()[1] == 1:  # the whole vocabulary here: torch's fused log-softmax + NLL, forward and backward
        return -F.cross_entropy(_scaled(logits, temperature), targets, reduction="none")
    return -vocab_parallel_cross_entropy(_scaled(logits, temperature, copy=True), targets)


def _scaled(logits: torch.Tensor, temperature: float, copy: bool = False) -> torch.Tensor:
    """float32 logits / T, without a division at T = 1; `copy`: never the caller's own tensor
    (megatron's cross entropy subtracts the maximum in place)."""
    if temperature != 1.0:
        return logits.float() / temperature
    return logits.to(torch.float32, copy=copy)


class AllReduceSum(torch.autograd.Function):
    """Sum over a group in forward, identity in backward (each rank owns its partial sum)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = logZ - sum_v p_v * x_v with x = logits / T, over the TP-sharded vocabulary.

    logZ = m + log(sum_v exp(x_v - m)) with m the global max (a constant for autograd, as in a
    stable logsumexp). Differentiable through the partial sums.
    """
    group, world, _ = _tp()
    x = _scaled(logits, temperature)
    m = x.detach().amax(dim=-1)
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m.unsqueeze(-1))
    sum_e = e.sum(-1)
    sum_ex = (e * x).sum(-1)
    if world > 1:
        sum_e = AllReduceSum.apply(sum_e, group)
        sum_ex = AllReduceSum.apply(sum_ex, group)
    log_z = m + torch.log(sum_e)
    return log_z - sum_ex / sum_e
