"""Token log-probs and entropy on vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the vocabulary. Both quantities need only
three TP all-reduces of [tokens]-sized tensors (max, sum-exp, and the target logit / expected
logit), never the full [tokens, V] matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] over the full (TP-sharded) vocabulary.

    logits: [..., V/tp] (this rank's vocab slice), targets: [...] global token ids.
    Differentiable: megatron's vocab_parallel_cross_entropy (which returns -log p) carries the
    gradient across the TP group correctly. The input is divided by T first, which also keeps
    megatron's in-place max subtraction off the caller's logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    return -vocab_parallel_cross_entropy(scaled, targets)


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
    x = logits.float() / temperature
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
