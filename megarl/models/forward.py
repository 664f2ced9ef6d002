"""Forward-only evaluation of megatron GPTModel chunks at any TP/PP/CP: full (gathered) logits.

Used by the conversion tool's `verify` and by tests; the trainer has its own token-budget
forward/backward path (megarl.trainer.train_model). Sequences run packed (THD), the way the
trainer runs them: padded to a multiple of 2*CP, cut into this CP rank's chunks, and the outputs
gathered back over TP (vocabulary) and CP (tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron attention mask [1, 1, s, s]: True above the diagonal (= masked)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def pack_sequences(seqs: list[torch.Tensor], multiple: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """(row [1, S], cu_seqlens of the padded sequences, start of every sequence) for 1-D id tensors."""
    cu, starts = [0], []
    for s in seqs:
        starts.append(cu[-1])
        cu.append(cu[-1] + -(-len(s) // multiple) * multiple)
    row = torch.zeros(1, cu[-1], dtype=torch.long)
    for s, st in zip(seqs, starts):
        row[0, st : st + len(s)] = s.cpu()
    return row, cu, starts


def packed_forward(model_chunks, seqs: list[torch.Tensor], grad: bool = False) -> list[torch.Tensor] | None:
    """Outputs (logits [L_i, V] gathered over TP, or values [L_i, 1]) of every sequence, on every
    rank of the last pipeline stage (None elsewhere), float32 on the training device. With
    grad=True the graph is kept (run it outside a PP schedule: PP = 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megarl.models.attention import cp_shard_index, gather_from_cp, runs_local_attention, thd_params
    from megarl.models.builder import unwrap
    from megarl.models.value_head import ValueModel
    from megarl.parallel.distributed import device

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    last = unwrap(chunks[-1])
    is_value_model = isinstance(last, ValueModel)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    row, cu, starts = pack_sequences(seqs, 2 * cp if cp > 1 else 1)
    mine = cp_shard_index(cu, cp, cp_rank) if cp > 1 else torch.arange(cu[-1])
    ids = row[:, mine].to(device())
    pos = torch.arange(cu[-1])[None, mine].to(device())
    params = thd_params(cu, device=device(), rope_on_host=runs_local_attention(chunks[0]))

    def step(data_iter, model):
        return model(next(data_iter), pos, None, packed_seq_params=params), None

    if ps.get_pipeline_model_parallel_world_size() == 1 and len(chunks) == 1:
        out = chunks[0](ids, pos, None, packed_seq_params=params)
    else:
        if grad:
            raise ValueError("packed_forward(grad=True) runs without pipeline parallelism")
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iters = [iter([ids]) for _ in chunks]
        res = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters if len(chunks) > 1 else iters[0],
            model=list(chunks), num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=1,
            forward_only=True)
        out = res[0] if ps.is_pipeline_last_stage() else None
    if out is None:
        return None
    out = out[0].float()  # [t_local, V/tp] (or [t_local, 1])
    if not is_value_model:  # value heads are replicated, not vocab-parallel
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., : last.hf_vocab_size]
    if cp > 1:
        order = torch.cat([cp_shard_index(cu, cp, r) for r in range(cp)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        out = gather_from_cp(out, ps.get_context_parallel_group())[inverse.to(out.device)]
    return [out[st : st + len(s)] for s, st in zip(seqs, starts)]


@torch.no_grad()
def megatron_forward_logits(model_chunks, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] (HF vocab, TP-gathered, padding stripped) on every rank, float32, on the
    host; `input_ids` may live anywhere. Every row is one sequence.

    For a critic (`build_model(value_head=True)`) the result is the values [b, s, 1].
    With PP > 1 the last stage broadcasts the result over the pipeline group.
    """
    from megatron.core import parallel_state as ps

    from megarl.models.builder import unwrap
    from megarl.models.value_head import ValueModel
    from megarl.parallel.distributed import device

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        chunk.eval()
    last = unwrap(chunks[-1])
    width = 1 if isinstance(last, ValueModel) else last.hf_vocab_size
    b, s = input_ids.shape
    outs = packed_forward(chunks, list(input_ids.cpu()))
    out = torch.stack(outs) if outs is not None else None
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        if out is None:
            out = torch.empty(b, s, width, dtype=torch.float32, device=device())
        out = out.contiguous()
        dist.broadcast(out, src=src, group=group)
    return out.cpu()
