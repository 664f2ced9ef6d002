"""Worker: megatron-core GPTModel trained 2 steps under several TP/PP/DP layouts on gloo.

Run by tests/distributed/test_cpu_runtime.py under torchrun with 4 ranks. The TP=1 x PP=1
(DP=4) model is initialised, saved as a torch_dist checkpoint (--root/ckpt), and every other layout loads it,
so all layouts start from the same weights and see the same global batch. Writes per-layout
losses and grad norms to --out.
"""

import torch
import torch.distributed as dist

from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from tests.distributed.harness import finish, parse_args

VOCAB, SEQ, GLOBAL_BATCH, MICRO = 96, 12, 8, 1


def build(tp, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
        max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
    )
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True), [ddp]
    )
    return ddp, opt


def train(ddp, opt, steps=2):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device()).triu(1)[None, None]
    losses, norms = [], []
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
        local = batch.chunk(dp)[dp_rank]
        micro = list(local.to(device()).split(MICRO))

        def fwd(it, model):
            ids = next(it)
            pos = torch.arange(SEQ, device=ids.device)[None].expand_as(ids)
            out = model(ids, pos, mask, labels=ids)
            return out, lambda o: (o.mean(), {"loss": o.mean().detach().clone()})

        ddp.zero_grad_buffer()
        opt.zero_grad()
        logs = get_forward_backward_func()(
            forward_step_func=fwd, data_iterator=iter(micro), model=[ddp],
            num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=MICRO,
        )
        _, grad_norm, _ = opt.step()
        loss = torch.tensor(sum(float(x["loss"]) for x in logs) / max(len(logs), 1), device=device())
        if ps.is_pipeline_last_stage():
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            loss /= dp
        # broadcast the last stage's value so rank 0 can record it
        src = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast(loss, src=src, group=ps.get_pipeline_model_parallel_group())
        losses.append(float(loss))
        norms.append(float(grad_norm))
    return losses, norms


def main():
    args = parse_args()
    ckpt = str(args.root / "ckpt")
    from megatron.core import dist_checkpointing

    results = {}
    for tp, pp in [(1, 1), (2, 2), (2, 1), (1, 2)]:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=7)
        ddp, opt = build(tp, pp)
        if (tp, pp) == (1, 1):
            dist_checkpointing.save(ddp.module.sharded_state_dict(), ckpt)
        else:
            state = dist_checkpointing.load(ddp.module.sharded_state_dict(), ckpt)
            ddp.module.load_state_dict(state)
        dist.barrier()
        results[f"tp{tp}_pp{pp}"] = dict(zip(["losses", "grad_norms"], train(ddp, opt)))
    finish(args.out, results)


if __name__ == "__main__":
    main()
