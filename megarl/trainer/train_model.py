"""A megatron-core model being trained (actor, critic) or only run forward (reference).

Wraps model building, megatron DDP + optimizer, the LR schedule, packed micro-batches through
`forward_backward_func` (1F1B under PP), and torch_dist checkpoints of model + optimizer.

Loss scaling: the loss callbacks return a micro-batch's share of the mini-batch loss, already
divided by global (all micro-batches, all DP ranks) denominators. The schedule divides every
micro-batch loss by num_microbatches and DDP averages gradients over DP, so the value handed
to megatron is multiplied by num_microbatches * dp_size to make the gradient exactly that of
the global-batch loss.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megarl.models.attention import thd_params
from megarl.parallel import host_offload
from megarl.parallel.distributed import device
from megarl.trainer import offload
from megarl.trainer.batch import MicroBatch, StepBatch, TokenLayout, Trajectory, split_microbatches

LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lr_at(step: int, optim, total_steps: int) -> float:
    """Linear warm-up over `lr_warmup_steps` rollout steps, then constant / linear / cosine decay."""
    if optim.lr_warmup_steps > 0 and step < optim.lr_warmup_steps:
        return optim.lr * (step + 1) / optim.lr_warmup_steps
    if optim.lr_decay_style == "constant":
        return optim.lr
    decay_steps = max(1, (optim.lr_decay_steps or total_steps) - optim.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - optim.lr_warmup_steps) / decay_steps))
    if optim.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return optim.min_lr + (optim.lr - optim.min_lr) * coeff


class TrainModel:
    def __init__(self, hf_config, optim=None, *, value_head: bool = False, dtype: str = "fp32",
                 impl: str = "local", total_steps: int = 1, padded_vocab: int | None = None, seed: int = 0,
                 batching=None, model_options: dict | None = None, logprob_chunk_tokens: int = 4096,
                 freeze_router: bool = False, routing_replay: bool = False, track_routing: bool = False,
                 freeze_vision: bool = False):
        """Vision-language models: freeze_vision keeps the vision tower (patch embedding, blocks,
        merger) out of the gradient and the optimizer.
        MoE: freeze_router keeps the router weights out of the gradient and the optimizer;
        routing_replay makes the routers use the engine's experts of micro-batches that carry them
        (megarl.models.routing); track_routing measures the engine/trainer routing agreement in
        `forward_only` passes (`routing_metrics`)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        from megarl.models import build_model

        self.hf_config = hf_config
        self.optim_cfg = optim
        self.value_head = value_head
        self.total_steps = total_steps
        batching = batching or optim  # micro-batching settings (an OptimConfig); ref models borrow the actor's
        self.max_tokens = batching.max_tokens_per_microbatch if batching else 32768
        self.chunk_tokens = logprob_chunk_tokens
        self.hf_source_dir: str | None = None  # copied into checkpoints (tokenizer files)
        from megarl.models import routing

        if routing_replay:
            model_options = {**(model_options or {}), "moe_enable_routing_replay": True}
        self.rope_on_host = impl == "local"  # megarl.models.attention.thd_params
        chunks = build_model(hf_config, value_head=value_head, dtype=dtype, impl=impl,
                             padded_vocab=padded_vocab, seed=seed, config_overrides=model_options)
        self.chunks = chunks if isinstance(chunks, list) else [chunks]
        self.config = self.chunks[0].config
        self.is_moe = bool(self.config.num_moe_experts)
        self.routing_replay = routing_replay and self.is_moe
        self.track_routing = track_routing and self.is_moe
        self.routing_metrics: dict[str, float] = {}  # of the last forward_only pass with routing
        self.moe_layers = routing.local_moe_layers(self.chunks)  # this stage's MoE layers (global indices)
        self.uses_routed_experts = self.routing_replay or self.track_routing  # the engine's experts reach it
        if self.routing_replay:
            routing.install_replay_hooks(self.chunks)
        if freeze_router:  # before DDP: parameters without requires_grad get no grad buffer, no optimizer state
            for c in self.chunks:
                for _, router in routing.moe_routers(c):
                    router.requires_grad_(False)
        self.vision = self.chunks[0].arch_spec.vision  # VisionSpec of a vision-language model, else None
        if freeze_vision:
            if self.vision is None:
                raise ValueError("model.freeze_vision=true but the model has no vision tower")
            for c in self.chunks:
                if getattr(c, "vision_model", None) is not None:
                    c.vision_model.requires_grad_(False)
        self.layout = token_layout(self.config)  # CP / SP / FP8 split of every packed row
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        self.optimizer = None
        self._moved: dict[str, offload.Moved] = {}  # what `offload` moved, by part (offload.PARTS)
        self._host_buffers: dict = {}  # pinned host copies, reused by every offload
        if optim is not None:
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=optim.use_distributed_optimizer
            )
            self.chunks = [DistributedDataParallel(self.config, ddp_cfg, c) for c in self.chunks]
            self.config.finalize_model_grads_func = finalize_model_grads
            self.optimizer = self._make_optimizer(optim, dtype)
            # the schedules scale the loss by it before backward (fp16 loss scaling; 1 otherwise)
            self.config.grad_scale_func = self.optimizer.scale_loss
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        # MoE with expert parallelism: the token all-to-alls span DP ranks, so every DP rank must
        # run the same number of micro-batches (`microbatches`)
        self.same_microbatch_count = self.is_moe and ps.get_expert_model_parallel_world_size() > 1
        self.dp_size = ps.get_data_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage()

    def _make_optimizer(self, optim, dtype):
        from megatron.core.optimizer import get_megatron_optimizer

        if optim.offload_optimizer and not host_offload.available():
            raise ValueError("offload_optimizer=true keeps optimizer state on the CPU instead of the GPU, "
                             "but there is no GPU here: set it to false")
        if optim.offload_optimizer and dtype == "fp32":
            # megatron 0.16.1 hands HybridDeviceOptimizer the fp32 shards as views of the
            # parameters that keep their autograd history; torch rejects them ("can't optimize a
            # non-leaf Tensor"). Its 16-bit shards are detached views and work.
            raise ValueError("offload_optimizer=true needs model.dtype bf16 or fp16: megatron's "
                             "HybridDeviceOptimizer cannot take fp32 parameter shards")
        return get_megatron_optimizer(optimizer_config(optim, dtype), self.chunks)

    # ---- modules ---------------------------------------------------------------------------
    @property
    def modules(self):
        """The bare GPTModel chunks (unwrapped from DDP)."""
        return [getattr(c, "module", c) for c in self.chunks]

    @torch.no_grad()
    def copy_backbone_from(self, other: "TrainModel") -> int:
        """Copies every parameter that `other` has under the same name and shape (the whole
        transformer; not the output layer / value head). Same parallel layout required."""
        n = 0
        for mine, theirs in zip(self.modules, other.modules):
            src = dict(theirs.named_parameters())
            for name, p in mine.named_parameters():
                if name in src and src[name].shape == p.shape and not name.startswith("output_layer"):
                    p.copy_(src[name])
                    n += 1
        if self.optimizer is not None:
            self.optimizer.reload_model_params()
        return n

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.optim_cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def microbatches(self, batch: StepBatch, rows: list[int] | None = None, training: bool = False) -> list[MicroBatch]:
        """Token-budget micro-batches (first-fit-decreasing, whole sequences) of `rows` (default
        all), each one packed THD row cut to this CP rank's chunks; host tensors, moved to the
        device one at a time by the schedule.

        Collective over DP where it has to be: a MoE model with expert parallelism runs as many
        micro-batches on every DP rank as the rank with the most (its all-to-alls span DP ranks),
        and a training pass with no rows here still runs one (DDP reduces the gradients of every
        rank). The missing ones are `padding_microbatch`es: a forward and backward with zero loss
        weight, so every collective inside the model matches and the update does not change.
        """
        rows = list(range(len(batch))) if rows is None else rows
        mbs = split_microbatches(batch, rows, self.max_tokens, self.layout, self.chunk_tokens, self.vision) if rows else []
        want = len(mbs)
        if self.same_microbatch_count and dist.is_initialized():
            n = torch.tensor([want], dtype=torch.int64, device=device())
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.dp_group)
            want = int(n.item())
        if training:
            want = max(want, 1)
        mbs += [self.padding_microbatch(batch) for _ in range(want - len(mbs))]
        return [mb.cp_shard(self.cp_rank, self.cp_size) for mb in mbs] if self.cp_size > 1 else mbs

    def padding_microbatch(self, batch: StepBatch) -> MicroBatch:
        """A micro-batch of one short row of token 0 (the smallest length the layout allows) that
        trains nothing: its loss is multiplied by zero and `forward_only` ignores it. With routing
        replay it replays experts 0..k-1, as the padding of every packed row does."""
        n = max(2, self.layout.row_multiple)
        routed = None
        if batch.routed_experts is not None:
            k, cols, dt = self.config.moe_router_topk, batch.routed_experts[0].shape[1], batch.routed_experts[0].dtype
            routed = torch.arange(k, dtype=dt).expand(n, cols, k).clone()
        t = Trajectory("padding", [0] * (n - 1), [0], [0.0], "stop", routed_experts=routed)
        mb = split_microbatches(StepBatch.from_trajectories([t]), [0], n, self.layout, self.chunk_tokens, self.vision)[0]
        return dataclasses.replace(mb, rows=[], data=batch.select([]), padding=True)

    # ---- GPU memory between phases -----------------------------------------------------------
    def offload(self, weights: bool = True) -> None:
        """Frees this model's GPU memory while the colocated rollout engine has the GPU.

        Gradients are dropped (they are zeroed before every update) and the optimizer's own
        tensors (fp32 main params, Adam moments) go to the host; with `weights` the weights too.
        `weights=False` is the weight sync's: the engine reads the trainer's weights. A later call
        moves what is still here. megarl.trainer.offload says how (storage moved in place) and
        why megatron's own optimizer offload is not used. No-op without a GPU (or its CPU
        model, megarl.parallel.host_offload).
        """
        if not host_offload.available():
            return
        parts = offload.PARTS if weights else offload.PARTS[:1]
        todo = [part for part in parts if part not in self._moved]
        for part in todo:
            self._moved[part] = offload.to_host(self.chunks, self.optimizer, part, self._host_buffers)
        if todo:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def host_weight(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s values: the parameter itself, or its host copy while the weights are offloaded
        (the weight stream's source with rollout.sync_from_host)."""
        moved = self._moved.get("weights")
        view = offload.host_view(moved, param) if moved is not None else None
        return param if view is None else view

    def onload(self) -> None:
        """Undoes `offload`: every tensor it moved is back on the GPU, views of DDP's buffers intact."""
        if not self._moved:
            return
        for part in reversed(offload.PARTS):
            if part in self._moved:
                offload.to_device(self._moved[part])
        torch.cuda.synchronize()
        self._moved = {}

    # ---- forward / backward ----------------------------------------------------------------
    def _forward_step(self, loss_fn: LossFn, scale: float, observer=None):
        from megarl.models import routing

        def forward_step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            params = thd_params(mb.cu_seqlens, device=device(), rope_on_host=self.rope_on_host)  # read on the host, once
            mb = mb.to(device())
            if self.is_moe and mb.routed_experts is not None:
                columns = routing.routing_columns(mb.routed_experts, self.config, self.moe_layers)
                local = routing.sequence_parallel_slice(mb.routed_experts.shape[0], self.config)
                if self.routing_replay:
                    routing.set_replay(model, mb.routed_experts[local], columns)
                if observer is not None:
                    observer.expect(model, None if mb.padding else mb.routed_experts[local], mb.routing_valid[local],
                                    columns)
            elif self.routing_replay:
                routing.set_replay(model, None)
            out = model(mb.input_ids, mb.position_ids, None, packed_seq_params=params,
                        **mb.vision_inputs)

            def loss_func(output):
                if mb.padding:  # trains nothing; keeps the collectives of the backward in step
                    return output.float().sum() * 0.0, {}
                loss, logs = loss_fn(mb, output)
                return loss * scale, logs

            return out, loss_func

        return forward_step

    def run(self, microbatches: list[MicroBatch], loss_fn: LossFn, forward_only: bool, observer=None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megarl.models import routing

        n = len(microbatches)
        scale = float(n * self.dp_size) if not forward_only else 1.0
        max_len = max(int(mb.input_ids.shape[1]) for mb in microbatches)
        if self.routing_replay:
            routing.clear_replay(self.chunks)
        try:
            return self._schedule(get_forward_backward_func(), microbatches, loss_fn, scale, forward_only, max_len,
                                  observer)
        finally:
            if self.routing_replay:
                routing.clear_replay(self.chunks)

    def _schedule(self, fb, microbatches, loss_fn, scale, forward_only, max_len, observer):
        n = len(microbatches)
        return fb(
            forward_step_func=self._forward_step(loss_fn, scale, observer),
            data_iterator=iter(microbatches),
            model=self.chunks,
            num_microbatches=n,
            seq_length=max_len,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def forward_only(self, batch: StepBatch, per_token_fn) -> torch.Tensor:
        """Runs `per_token_fn(mb, output) -> [n, T_mb]` on every micro-batch and returns the
        results as a [B, T] float32 host tensor aligned with `batch`, on every PP stage
        (broadcast from the last, which alone computes outputs)."""
        microbatches = self.microbatches(batch)
        out = torch.zeros(len(batch), batch.width, device=device())
        for c in self.chunks:
            c.eval()

        def loss_fn(mb, output):
            vals = per_token_fn(mb, output)
            out[torch.tensor(mb.rows, device=out.device), : vals.shape[1]] = vals.detach().float()
            return output.new_zeros(()), {}

        observer = None
        if self.track_routing and batch.routed_experts is not None:
            from megarl.models.routing import RoutingObserver

            observer = RoutingObserver(self.chunks)
        try:
            if microbatches:
                self.run(microbatches, loss_fn, forward_only=True, observer=observer)
        finally:
            if observer is not None:
                observer.close()
        if observer is not None:
            self.routing_metrics = self._agreement(observer.stats)
        for c in self.chunks:
            c.train()
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(out, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
        return out.cpu() * batch.response_mask

    def _agreement(self, stats: torch.Tensor) -> dict[str, float]:
        """Routing agreement over every rank's tokens and layers (each (token, layer) pair is routed
        on exactly one rank: tokens split over DP / CP / SP, layers over PP)."""
        from megarl.models.routing import agreement_metrics

        stats = stats.to(device())
        dist.all_reduce(stats)
        return agreement_metrics(stats.cpu(), self.routing_replay)

    def train_step(self, batch: StepBatch, loss_fn: LossFn, rows: list[int] | None = None) -> dict[str, float]:
        """One optimizer step over micro-batches of `rows` of the batch (default all). Returns
        summed metrics (already normalised by global denominators in loss_fn) plus grad_norm."""
        microbatches = self.microbatches(batch, rows, training=True)
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        logs = self.run(microbatches, loss_fn, forward_only=False) if microbatches else []
        ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}: step aborted")
        metrics = _sum_logs(logs)
        metrics = _reduce_metrics(metrics, self.pp_group, self.dp_group, self.is_last_stage)
        metrics["grad_norm"] = float(grad_norm or 0.0)
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Collective: <path>/model (+ hf/ and metadata, see megarl.weights.dist_ckpt) and, when
        training, <path>/optimizer (torch_dist, each rank writing only its own optimizer shard,
        reloadable under another DP/TP/PP/EP layout: megarl.weights.optim_ckpt)."""
        from megarl.weights import dist_ckpt, optim_ckpt

        dist_ckpt.save_megatron_checkpoint(self.chunks, path, self.hf_config, self.hf_source_dir)
        if self.optimizer is not None:
            if dist.get_rank() == 0:
                Path(path, "optimizer").mkdir(parents=True, exist_ok=True)
            dist.barrier()
            optim_ckpt.save(self.optimizer, dist_ckpt.model_sharded_state_dict(self.chunks), Path(path, "optimizer"))
            dist.barrier()

    def load(self, path: str, load_optimizer: bool = True) -> None:
        from megarl.weights import dist_ckpt, optim_ckpt

        dist_ckpt.load_megatron_checkpoint(self.chunks, path)
        if self.optimizer is not None and load_optimizer:
            opt_dir = Path(path, "optimizer")
            dist_ckpt.check_checkpoint_files(opt_dir)
            optim_ckpt.load(self.optimizer, dist_ckpt.model_sharded_state_dict(self.chunks), opt_dir)


def optimizer_config(optim, dtype: str):
    """megatron's OptimizerConfig for an OptimConfig (actor / critic section) and model dtype."""
    import megatron.core.optimizer.optimizer_config as oc
    from megatron.core.utils import get_te_version

    kwargs = dict(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, use_distributed_optimizer=optim.use_distributed_optimizer,
        bf16=dtype == "bf16", fp16=dtype == "fp16", params_dtype=_torch_dtype(dtype),
        # megatron's HybridDeviceOptimizer: Adam state and step on the CPU (GPU only); megatron
        # supports it only as a precision-aware distributed optimizer
        optimizer_cpu_offload=optim.offload_optimizer,
        use_precision_aware_optimizer=optim.offload_optimizer,
        optimizer_offload_fraction=1.0 if optim.offload_optimizer else 0.0,
    )
    if not optim.offload_optimizer or get_te_version() is not None:
        return oc.OptimizerConfig(**kwargs)
    # the precision-aware check of megatron 0.16.1 compares Transformer Engine's version, None
    # without TE (a TypeError); HybridDeviceOptimizer needs no TE, and "TE >= 2.1" is false here
    check, oc.is_te_min_version = oc.is_te_min_version, lambda *args, **kw: False
    try:
        return oc.OptimizerConfig(**kwargs)
    finally:
        oc.is_te_min_version = check


def _torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def fp8_token_alignment(recipe, sequence_parallel: bool) -> int:
    """What each rank's token count must be a multiple of for Transformer Engine's FP8 linear
    layers (checked against TE 2.11). TE asserts on the rank's own input, before any sequence-
    parallel all-gather: at least 8 rows (`assert_dim_for_fp8_exec`), 16 for cuBLAS's FP8 leading
    dimensions (the weight-gradient GEMM reduces over tokens); MXFP8 scales blocks of 32 along
    every dimension; blockwise quantizes 1x128 blocks, and an input it all-gathers (column-parallel
    layers under SP) must be quantizable, i.e. its rows a multiple of 128 (`is_quantizable`)."""
    name = getattr(recipe, "value", recipe)
    if name not in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        raise ValueError(f"no token alignment known for FP8 recipe {name!r}")
    if name == "mxfp8":
        return 32
    return 128 if name == "blockwise" and sequence_parallel else 16


def token_layout(config) -> TokenLayout:
    """How packed rows split over this model's ranks (a megatron TransformerConfig): every sequence
    in 2*CP chunks, each CP rank's share over the TP ranks under sequence parallelism, and under
    FP8 every rank's part a multiple of `fp8_token_alignment`; `split_microbatches` pads for it."""
    sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    align = fp8_token_alignment(config.fp8_recipe, sp > 1) if config.fp8 else 1
    return TokenLayout(cp=config.context_parallel_size, sp=sp, align=align)


def _sum_logs(logs: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in logs:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def _reduce_metrics(metrics: dict[str, float], pp_group, dp_group, is_last: bool) -> dict[str, float]:
    """Sums metrics over DP (each is already a share of a global mean) and shares them with all
    PP stages (only the last stage computes losses). A DP rank that ran only padding micro-batches
    has no metrics: the keys are the union over DP, its values 0."""
    keys = sorted(metrics) if is_last else None
    if is_last and dist.get_world_size(dp_group) > 1:
        every: list = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(every, keys, group=dp_group)
        keys = sorted({k for ks in every for k in ks})
    holder = [keys]
    if dist.get_world_size(pp_group) > 1:
        src = dist.get_process_group_ranks(pp_group)[-1]
        dist.broadcast_object_list(holder, src=src, group=pp_group)
    keys = holder[0] or []
    vals = torch.tensor([metrics.get(k, 0.0) for k in keys], dtype=torch.float64, device=device())
    if keys:
        if is_last:
            dist.all_reduce(vals, group=dp_group)
        if dist.get_world_size(pp_group) > 1:
            src = dist.get_process_group_ranks(pp_group)[-1]
            dist.broadcast(vals, src=src, group=pp_group)
    return dict(zip(keys, vals.cpu().tolist()))
