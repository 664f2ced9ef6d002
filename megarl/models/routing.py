"""MoE routing replay (R3) and the engine/trainer routing agreement, on megatron-core's RouterReplay.

The rollout engine records, for every token it forwards, the experts each MoE layer selected
(`routed_experts`: [tokens, layers, top_k] per sample, prompt and response). With
`algorithm.routing_replay` the trainer's routers use those experts instead of their own top-k
(megatron `TransformerConfig.moe_enable_routing_replay`, `RouterReplay`): the gate weights of the
replayed experts still come from the trainer's router (and get gradients), only the selection is
the engine's. Before each micro-batch's forward on a pipeline stage the indices of that stage's
MoE layers are set, in the order the router sees the tokens: the packed THD row
(`MicroBatch.routed_experts`), cut to this CP rank's tokens (`MicroBatch.cp_shard`), then to this
TP rank's contiguous slice under sequence parallelism.

Activation recompute: a layer recomputed in the backward calls its router again; a forward
pre-hook switches that router to REPLAY_BACKWARD there, which pops the indices set for the
micro-batches in order (1F1B runs the backwards in forward order), so recompute replays the
same experts.

Columns: engines record every layer (dense ones included); the trainer receives only the MoE
layers of its pipeline stage (megarl.trainer.rows), in uint8 where the experts fit
(`routing_columns` maps either layout).

Only the trained actor replays (and measures agreement): the reference model and the critic
route natively.

Agreement: while observing, a forward hook compares the engine's experts with the router's
native top-k (recomputed from its input, with no replay) and with what it actually used, over
the tokens the engine really forwarded (`MicroBatch.routing_valid`).
"""

from __future__ import annotations

import torch


def moe_routers(chunk) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer index, TopKRouter) of every MoE layer in this model chunk."""
    from megarl.models.builder import unwrap

    gpt = unwrap(chunk)
    if not hasattr(gpt, "decoder"):
        return []
    return [(layer.layer_number - 1, layer.mlp.router) for layer in gpt.decoder.layers
            if hasattr(getattr(layer, "mlp", None), "router")]


def sequence_parallel_slice(n_tokens: int, config) -> slice:
    """The tokens of this TP rank under sequence parallelism (megatron scatters the sequence in
    contiguous equal parts); all of them without it."""
    if not config.sequence_parallel or config.tensor_model_parallel_size == 1:
        return slice(0, n_tokens)
    from megatron.core import parallel_state as ps

    tp, rank = config.tensor_model_parallel_size, ps.get_tensor_model_parallel_rank()
    if n_tokens % tp:
        raise ValueError(f"{n_tokens} tokens do not split over {tp} sequence-parallel ranks")
    per = n_tokens // tp
    return slice(rank * per, (rank + 1) * per)


def local_moe_layers(chunks) -> list[int]:
    """Global 0-based indices of the MoE layers in these model chunks (this pipeline stage), sorted:
    the columns of the routed experts the trainer receives (megarl.trainer.rows)."""
    return sorted({idx for chunk in chunks for idx, _ in moe_routers(chunk)})


def routing_columns(routed: torch.Tensor, config, moe_layers: list[int]) -> dict[int, int]:
    """Global layer index -> column of `routed` ([tokens, columns, top_k]): the columns are either
    every layer of the model (dense ones included, as engines record them) or this stage's MoE
    layers `moe_layers` (what the trainer receives)."""
    if routed.dim() != 3 or routed.shape[2] != config.moe_router_topk or \
            routed.shape[1] not in (config.num_layers, len(moe_layers)):
        raise ValueError(f"routed_experts has shape {tuple(routed.shape)}; the model routes [tokens, "
                         f"{config.num_layers} layers or this stage's {len(moe_layers)} MoE layers, "
                         f"top-{config.moe_router_topk}]")
    if routed.shape[1] == len(moe_layers):
        return {layer: col for col, layer in enumerate(moe_layers)}
    return {layer: layer for layer in moe_layers}


def set_replay(chunk, routed: torch.Tensor | None, columns: dict[int, int] | None = None) -> None:
    """REPLAY_FORWARD of `routed` ([tokens the routers of this chunk see, columns, top_k]; layer i
    in column columns[i], default i) for this chunk's routers; routed=None: native routing."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for idx, router in moe_routers(chunk):
        rr = router.router_replay
        if rr is None:
            raise RuntimeError("routing replay needs the model built with moe_enable_routing_replay=True")
        if routed is None:
            rr.clear_router_replay_action()
            continue
        rr.set_target_indices(routed[:, idx if columns is None else columns[idx]].to(torch.long))
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(chunks) -> None:
    """Drops every stored index and action (after a forward / forward-backward pass)."""
    for chunk in chunks:
        for _, router in moe_routers(chunk):
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _replay_action_hook(router, args):
    """REPLAY_BACKWARD while autograd recomputes the layer, REPLAY_FORWARD otherwise."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rr = router.router_replay
    if rr is not None and rr.router_replay_action is not None:
        rr.router_replay_action = (RouterReplayAction.REPLAY_BACKWARD if _in_backward()
                                   else RouterReplayAction.REPLAY_FORWARD)


def install_replay_hooks(chunks) -> None:
    for chunk in chunks:
        for _, router in moe_routers(chunk):
            router.register_forward_pre_hook(_replay_action_hook)


def native_routing_map(router, hidden: torch.Tensor) -> torch.Tensor:
    """[tokens, E] bool: the experts the router's own top-k picks for `hidden` (no replay)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    c = router.config
    logits = router.gating(hidden).view(-1, c.num_moe_experts)
    _, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias, router_replay=None)
    return routing_map


def expert_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[tokens, k] expert indices -> [tokens, E] bool selection."""
    out = torch.zeros(indices.shape[0], num_experts, dtype=torch.bool, device=indices.device)
    return out.scatter(1, indices.to(torch.long), True)


class RoutingObserver:
    """Counts, over the valid tokens of the observed forwards, the (token, layer, expert-slot)
    triples where the router's native top-k / the experts it used equal the engine's:
    stats = [native agreeing slots, used agreeing slots, slots]. Per micro-batch, `expect` sets
    the engine's experts and valid-token mask of the tokens this rank's routers see."""

    def __init__(self, chunks):
        self.stats = torch.zeros(3, dtype=torch.float64)
        self._target: dict[int, tuple] = {}  # chunk id -> (routed, valid, columns)
        self._handles = [router.register_forward_hook(self._hook(id(chunk), idx))
                         for chunk in chunks for idx, router in moe_routers(chunk)]

    def expect(self, chunk, routed: torch.Tensor, valid: torch.Tensor, columns: dict[int, int] | None = None) -> None:
        """`columns`: global layer -> column of `routed` (`routing_columns`; default the layer index);
        routed=None: nothing to compare in the next forward (a padding micro-batch)."""
        if routed is None:
            self._target.pop(id(chunk), None)
        else:
            self._target[id(chunk)] = (routed, valid, columns)

    def _hook(self, key: int, layer: int):
        def hook(router, args, output):
            if _in_backward() or key not in self._target:
                return
            routed, valid, columns = self._target[key]
            used = output[1].view(-1, router.config.num_moe_experts)
            with torch.no_grad():
                native = native_routing_map(router, args[0])
            engine = expert_map(routed[:, layer if columns is None else columns[layer]], used.shape[1])
            v = valid.to(used.device)
            self.stats += torch.tensor([float((native & engine)[v].sum()), float((used & engine)[v].sum()),
                                        float(v.sum()) * router.topk], dtype=torch.float64)

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._target.clear()


def agreement_metrics(stats: torch.Tensor, replay: bool) -> dict[str, float]:
    """moe/routing_agreement: fraction of slots where the trainer's native top-k equals the engine's;
    moe/replayed_fraction (with replay): fraction where the experts the router used equal them."""
    slots = max(float(stats[2]), 1.0)
    out = {"moe/routing_agreement": float(stats[0]) / slots}
    if replay:
        out["moe/replayed_fraction"] = float(stats[1]) / slots
    return out
