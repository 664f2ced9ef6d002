"""Worker for tests/distributed/test_optim_checkpoint.py: optimizer checkpoints that change DP.

--phase save (2 gloo ranks, DP=2): four models, each 2 updates of a fixed batch, then saved by
TrainModel.save (megarl.weights.optim_ckpt: every rank writes only its own shard), then 2 more
updates (the uninterrupted run: their losses and grad norms). Cases: the dense tiny actor, a tiny
qwen3_moe actor at EP=2 with frozen routers (megatron's dense + expert-parallel optimizer chain)
and one at EP=1 (one optimizer), the tiny critic (value head). Every rank dumps its optimizer
shard (per parameter name: the range it owns of the flattened parameter and the fp32 main
weights / Adam moments there). The dense actor and the EP=2 MoE actor are also saved by
megatron's own gathering `fully_reshardable` writer (megarl's writer before the sharded one; the
MoE chain's keys carry megatron's `chained_<i>.` prefix), the dense one also in megatron's
`dp_reshardable` format (not readable here). Bytes: per rank, the optimizer-state elements the
sharded state dict of each writer references, and the bytes it allocates beyond the optimizer's
own storage. Last, `hybrid_round_trip` (offload_optimizer).

--phase load (4 gloo ranks, DP=4): each case loads at DP=4 (the MoE ones at EP=1, one optimizer
instead of the chain, and at EP=2, a chain instead of one optimizer) and runs the same 2
updates; the dense actor and the critic compare their loaded shards bit for bit with the DP=2
dumps; the dense and MoE actors also load the gathered checkpoints, the dense one once without
its optimizer state (control); the dp_reshardable one must fail naming its file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights import dist_ckpt, optim_ckpt
from tests.distributed.harness import dp_update, finish, gather, on_rank0, parse_args, train_model
from tests.distributed.scripts_trainer import fixed_batch

STATES = ("param", "exp_avg", "exp_avg_sq")


def optimizers(model) -> list:
    return list(getattr(model.optimizer, "chained_optimizers", [model.optimizer]))


def shards(model) -> dict[str, tuple[int, int, dict]]:
    """Per parameter name: (start, stop) of the flattened parameter this rank's distributed
    optimizer owns and its states there (megatron's own range maps and state accessor)."""
    names = {id(p): n for c in model.modules for n, p in c.named_parameters()}
    out = {}
    for opt in optimizers(model):
        for per_dtype in opt.gbuf_ranges:
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        st = opt._get_main_param_and_optimizer_states(param)
                        out[names[id(param)]] = (ranges["param"].start, ranges["param"].end,
                                                 {k: st[k].detach().reshape(-1).cpu().clone() for k in STATES})
    return out


def state_storages(model) -> set[int]:
    """The storages of the optimizer's own fp32 main weights and Adam moments."""
    return {t.untyped_storage().data_ptr() for opt in optimizers(model) for st in opt.optimizer.state.values()
            for t in st.values() if torch.is_tensor(t) and t.dim() > 0} | {
        p.untyped_storage().data_ptr() for opt in optimizers(model) for g in opt.optimizer.param_groups
        for p in g["params"]}


def sd_bytes(sd: dict, own: set[int]) -> dict:
    """Elements of optimizer state the sharded state dict's tensors reference (under
    'param_state'), and the bytes of the storages they use that are not the optimizer's own."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    parts = [sd[k] for k in sorted(sd)] if all(isinstance(k, int) for k in sd) else [sd]
    tensors = [sh.data for p in parts for sh in nested_values(p["param_state"]) if hasattr(sh, "data")]
    extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
             if t.untyped_storage().data_ptr() not in own}
    return {"elements": sum(t.numel() for t in tensors), "extra_bytes": sum(extra.values())}


def writer_bytes(model) -> dict:
    """`sd_bytes` of the sharded writer (megarl) and of megatron's gathering one."""
    model_sd = dist_ckpt.model_sharded_state_dict(model.chunks)
    own = state_storages(model)
    sharded, _ = optim_ckpt.sharded_state_dict(model.optimizer, model_sd)
    gathered = model.optimizer.sharded_state_dict(model_sd,
                                                  metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return {"sharded": sd_bytes(sharded, own), "gathered": sd_bytes(gathered, own),
            "owned": sum(b - a for a, b, _ in shards(model).values()),
            "params": sum(p.numel() for c in model.modules for p in c.parameters() if p.requires_grad)}


def megatron_save(model, path: Path, sharding_type: str) -> None:
    """The model, then the optimizer by megatron's own writer in `sharding_type` (megarl's
    optimizer checkpoint before the sharded writer: 'fully_reshardable')."""
    from megatron.core import dist_checkpointing

    model.save(str(path))
    on_rank0(lambda: (shutil.rmtree(path / "optimizer"), (path / "optimizer").mkdir()))
    sd = model.optimizer.sharded_state_dict(dist_ckpt.model_sharded_state_dict(model.chunks),
                                            metadata={"distrib_optim_sharding_type": sharding_type})
    dist_checkpointing.save(sd, str(path / "optimizer"))
    dist.barrier()


CASES = {  # name: (model options, critic, layout at save, layout at load)
    "dense": ({}, False, dict(tp=1), dict(tp=1)),
    "moe_frozen_router": ({"freeze_router": True}, False, dict(ep=2), dict(ep=1)),
    "moe_ep1_to_ep2": ({}, False, dict(ep=1), dict(ep=2)),
    "critic": ({"value_head": True}, True, dict(tp=1), dict(tp=1)),
}


def build(cfg, case: str, hf_path: str, phase: str):
    kwargs, critic, save_layout, load_layout = CASES[case]
    init_distributed(ParallelSizes(**(save_layout if phase == "save" else load_layout)), seed=3)
    hf_config = AutoConfig.from_pretrained(hf_path)
    model = train_model(hf_config, cfg.critic if critic else cfg.actor, hf_path, **kwargs)
    model.hf_source_dir = hf_path
    batch = fixed_batch(hf_config.vocab_size, cfg)
    g = torch.Generator().manual_seed(5)
    batch.old_logprobs = (torch.full(batch.response_mask.shape, -2.0) + 0.1 * torch.randn(
        batch.response_mask.shape, generator=g)) * batch.response_mask
    batch.returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.values = torch.zeros_like(batch.returns)

    def updates(first: int) -> dict:
        ms = [dp_update(model, cfg, batch, step, critic=critic) for step in (first, first + 1)]
        role = "critic" if critic else "actor"
        key = "critic/value_loss" if critic else "actor/pg_loss"
        return {"losses": [m[key] for m in ms], "grad_norms": [m[f"{role}/grad_norm"] for m in ms]}

    return model, updates


def save_phase(cfg, root: Path, moe_path: str) -> dict:
    from tests.distributed.scripts_moe import make_tiny_moe

    on_rank0(make_tiny_moe, "qwen3_moe", moe_path)
    res = {}
    for case in CASES:
        model, updates = build(cfg, case, moe_path if case.startswith("moe") else cfg.model.hf_path, "save")
        updates(0)
        model.save(str(root / case / "sharded"))
        torch.save(shards(model), root / case / f"shards_{dist.get_rank()}.pt")
        if case in ("dense", "moe_frozen_router"):
            megatron_save(model, root / case / "gathered", "fully_reshardable")
        if case == "dense":
            megatron_save(model, root / case / "dp_reshardable", "dp_reshardable")
            res["bytes_dp2"] = gather(writer_bytes(model))
        res[case] = {"straight": updates(2), "chain": len(optimizers(model))}
    return res


def load_phase(cfg, root: Path, moe_path: str) -> dict:
    from megarl.weights.hf_reader import CheckpointError

    res = {}
    for case in CASES:
        hf = moe_path if case.startswith("moe") else cfg.model.hf_path
        out = res[case] = {}
        sources = {"dense": ["sharded", "gathered", "no_optimizer"],
                   "moe_frozen_router": ["sharded", "gathered"]}.get(case, ["sharded"])
        for source in sources:
            with_optimizer = source != "no_optimizer"
            model, updates = build(cfg, case, hf, "load")
            model.load(str(root / case / (source if with_optimizer else "sharded")), load_optimizer=with_optimizer)
            if with_optimizer and not case.startswith("moe"):  # same parameter names at both layouts
                out[f"{source}_mismatches"] = sum(gather(mismatches(shards(model), root / case)))
            if case == "dense" and source == "sharded":
                res["bytes_dp4"] = gather(writer_bytes(model))
            out[source] = updates(2)
            out["chain"] = len(optimizers(model))
    model, _ = build(cfg, "dense", cfg.model.hf_path, "load")
    try:
        model.load(str(root / "dense" / "dp_reshardable"))
        res["dp_reshardable_error"] = ""
    except CheckpointError as e:
        res["dp_reshardable_error"] = str(e)
    return res


def mismatches(mine: dict, case_dir: Path) -> int:
    """Loaded states (this rank's ranges) that differ from the DP=2 ranks' dumps, compared bit for bit."""
    saved = [torch.load(f, weights_only=True) for f in sorted(case_dir.glob("shards_*.pt"))]
    bad = 0
    for name, (start, stop, states) in mine.items():
        parts = sorted((s[name] for s in saved if name in s), key=lambda p: p[0])
        assert parts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(parts, parts[1:])), name
        for key, value in states.items():
            full = torch.cat([p[2][key] for p in parts])
            bad += not torch.equal(full[start:stop], value)
    return bad


def hybrid_round_trip(cfg, root: Path) -> dict:
    """offload_optimizer (megatron's HybridDeviceOptimizer, bf16, DP=2): its param groups hold
    optimizer classes, which a weights_only common.pt cannot; saved, stepped on, loaded back into
    the same optimizer (megatron 0.16.1 cannot build the state dict of a never-stepped one without
    Transformer Engine, so not into a fresh model here), then stepped again."""
    import dataclasses

    from megarl.parallel import host_offload

    init_distributed(ParallelSizes(), seed=3)
    host_offload.enable()
    hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
    optim = dataclasses.replace(cfg.actor, offload_optimizer=True)
    model = train_model(hf_config, optim, cfg.model.hf_path, dtype="bf16")
    batch = fixed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = torch.full(batch.response_mask.shape, -2.0) * batch.response_mask
    dp_update(model, cfg, batch, 0)
    model.save(str(root / "hybrid"))
    at_save = shards(model)
    dp_update(model, cfg, batch, 1)
    moved = shards(model)
    model.load(str(root / "hybrid"))
    back = shards(model)
    m = dp_update(model, cfg, batch, 1)

    def same(a, b):
        return all(torch.equal(a[n][2][k], b[n][2][k]) for n in a for k in STATES)
    return {"optimizer": type(optimizers(model)[0].optimizer).__name__, "moved": not same(at_save, moved),
            "loaded_equals_save_time": same(at_save, back), "step_after_load": m["actor/grad_norm"]}


def main():
    a = parse_args(config=True, phase="save")
    init_distributed(ParallelSizes(), seed=3)
    moe_path = str(a.root / "moe")
    if a.phase == "save":
        res = save_phase(a.cfg, a.root, moe_path)
        res["hybrid"] = hybrid_round_trip(a.cfg, a.root)  # last: host offload stays on for the process
    else:
        res = load_phase(a.cfg, a.root, moe_path)
    finish(a.out, res)


if __name__ == "__main__":
    main()
