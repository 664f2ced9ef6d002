"""Forward-only evaluation of megatron GPTModel chunks at any TP/PP: full (gathered) logits.

Used by the conversion tool's `verify` and by tests; the trainer has its own token-budget
forward/backward path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron attention mask [1, 1, s, s]: True above the diagonal (= masked)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


@torch.no_grad()
def megatron_forward_logits(model_chunks, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] (HF vocab, TP-gathered, padding stripped) on every rank, float32, on the
    host; `input_ids` may live anywhere (they are moved to the training device).

    For a critic (`build_model(value_head=True)`) the result is the values [b, s, 1].

    With PP > 1 the batch runs through megatron's forward-only pipeline schedule and the last
    stage broadcasts the logits over the pipeline group.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.builder import unwrap

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        chunk.eval()
    from megarl.models.value_head import ValueModel

    vocab = unwrap(chunks[-1]).hf_vocab_size
    is_value_model = isinstance(unwrap(chunks[-1]), ValueModel)
    from megarl.parallel.distributed import device

    input_ids = input_ids.to(device())
    b, s = input_ids.shape
    mask = causal_mask(s, input_ids.device)
    pos = torch.arange(s, device=input_ids.device)[None].expand(b, s)

    def step(data_iter, model):
        return model(next(data_iter), pos, mask), None

    if ps.get_pipeline_model_parallel_world_size() == 1 and len(chunks) == 1:
        out = chunks[0](input_ids, pos, mask)
    else:
        iters = [iter([input_ids]) for _ in chunks]
        res = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters if len(chunks) > 1 else iters[0],
            model=list(chunks), num_microbatches=1, seq_length=s, micro_batch_size=b,
            forward_only=True)
        out = res[0] if ps.is_pipeline_last_stage() else None
    width = 1 if is_value_model else vocab
    if out is not None and not is_value_model:  # value heads are replicated, not vocab-parallel
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., :vocab]
    if out is not None:
        out = out.float().contiguous()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        if out is None:
            out = torch.empty(b, s, width, dtype=torch.float32, device=input_ids.device)
        dist.broadcast(out, src=src, group=group)
    return out.cpu()
