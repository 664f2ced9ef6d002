"""`megarl plan --search`: the layouts of a recipe on N nodes, best planned step first.

It tries, for the rollout: parallel.rollout_tp (part of a node, or whole nodes with SGLang),
rollout.sglang_dp_size (attention data parallelism, text MoE models), rollout.sglang_ep_size (1
or the engine's GPUs), DeepEP's all-to-all with DP attention + EP (rollout.sglang_server_args
moe_a2a_backend: deepep), rollout.weights_dtype (bf16, fp8), rollout.mem_fraction, and
rollout.sync_from_host; for training: parallel.tp / pp / cp / ep (expert-TP 1) and
offload_optimizer of the actor and critic. Every candidate is planned by `megarl.planner.plan`
for every recipe given; one that does not fit any of them is dropped. Ranking: the first recipe's
planned step time (rollout + training + host copies) in buckets of STEP_TIE of the best, then
`Candidate.tie_break`.

The training time model is layout-independent (FLOPs / (GPUs x peak x MFU)): among training
layouts that fit, only the host copies an offloaded optimizer costs and the tie-break order tell
them apart. Rollout candidates are first planned against the recipe's own training layout,
training candidates against its own rollout settings; the best `ROLLOUT_SHORTLIST` rollouts are
then combined with every training layout that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from megarl.config import MegaRLConfig
from megarl.planner.arch import GPU, Arch
from megarl.planner.memory import Plan, plan

ROLLOUT_SHORTLIST = 24
MAX_ENGINE_NODES = 4  # the communication constants (megarl.planner.engine) are DeepEP's figures up to EP 32
MEM_FRACTIONS = (0.7, 0.8, 0.85)
TIGHT = 0.85  # a train peak above this fraction of the GPU ranks after those below it
STEP_TIE = 0.01  # planned steps within 1% of the best's apart rank as equal (the model is not that exact)


@dataclass
class Candidate:
    settings: dict[str, Any]  # dotted config key -> value
    plans: list[Plan] = field(default_factory=list)  # one per recipe
    gpus_per_node: int = 8

    @property
    def step_s(self) -> float:
        return self.plans[0].time["step_s"]

    @property
    def peak(self) -> float:
        """The highest phase peak over the recipes (bytes)."""
        return max(max(pl.rollout_peak, pl.sync_peak, pl.train_peak) for pl in self.plans)

    def tie_break(self) -> tuple:
        """Among equal planned steps: no host-streamed sync, no DeepEP (an extra dependency), no
        offloaded optimizer, the training all-to-all inside a node (EP <= gpus_per_node), a train
        peak within TIGHT of the capacity (headroom for what the model leaves out), smaller
        model-parallel groups, the train peak in tenths of the capacity, smaller EP, smaller engines."""
        s, cap = self.settings, self.plans[0].gpu.mem_bytes
        train = max(p.train_peak for p in self.plans)
        deepep = s["rollout.sglang_server_args"].get("moe_a2a_backend") == "deepep"
        return (s["rollout.sync_from_host"], deepep, s["actor.offload_optimizer"], s.get("critic.offload_optimizer", False),
                s["parallel.ep"] > self.gpus_per_node, train > TIGHT * cap,
                s["parallel.tp"] * s["parallel.pp"] * s["parallel.cp"], math.ceil(10 * train / cap), s["parallel.ep"],
                s["parallel.rollout_tp"])


def apply(cfg: MegaRLConfig, settings: dict[str, Any]) -> MegaRLConfig:
    """cfg with dotted settings (section.field) replaced; no validation (the planner checks)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kv)
                                       for sec, kv in sections.items()})


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def rollout_space(cfg: MegaRLConfig, arch: Arch, max_engine_nodes: int = MAX_ENGINE_NODES,
                  weights_dtypes: tuple[str, ...] = ("bf16", "fp8")) -> list[dict[str, Any]]:
    """Engines of part of a node, or (SGLang) of up to max_engine_nodes whole nodes; for a text
    MoE model on SGLang attention data parallelism over any power of two of the engine's GPUs and
    expert parallelism over all of them (required with DP attention and across nodes; else
    expert-TP, when the experts' width divides)."""
    p, r = cfg.parallel, cfg.rollout
    world, per_node = p.nodes * p.gpus_per_node, p.gpus_per_node
    sglang = r.engine == "sglang"
    tps = [t for t in _powers(world) if (t <= per_node and per_node % t == 0)
           or (sglang and t % per_node == 0 and world % t == 0 and t // per_node <= max_engine_nodes)]
    moe = bool(arch.num_experts) and sglang and arch.vision is None  # DP attention: text MoE models only
    out = []
    for tp in tps:
        dps = [d for d in _powers(tp)] if moe else [1]
        dtypes = ["bf16"] if arch.fp8 else list(weights_dtypes)  # a block-FP8 checkpoint is served as it is
        for dp, ep, dtype, mf, host, deepep in itertools.product(dps, sorted({1, tp}), dtypes, MEM_FRACTIONS,
                                                                 (False, True), (False, True)):
            expert_tp_ok = arch.moe_ffn % tp == 0 and dp == 1 and tp <= per_node
            if ep > 1 and not (moe and arch.num_experts % ep == 0) or ep == 1 and moe and not expert_tp_ok:
                continue
            if deepep and not (ep > 1 and dp > 1):  # DeepEP's all-to-all serves DP attention + EP
                continue
            args = {k: v for k, v in dict(r.sglang_server_args).items() if k != "moe_a2a_backend"}
            args.update({"moe_a2a_backend": "deepep"} if deepep else {})
            out.append({"parallel.rollout_tp": tp, "rollout.sglang_dp_size": dp, "rollout.sglang_ep_size": ep,
                        "rollout.weights_dtype": dtype, "rollout.mem_fraction": mf, "rollout.sync_from_host": host,
                        "rollout.offload_train_state": True, "rollout.sglang_server_args": args})
    return out


def train_space(cfg: MegaRLConfig, arch: Arch, critic: bool) -> list[dict[str, Any]]:
    p = cfg.parallel
    world, per_node = p.nodes * p.gpus_per_node, p.gpus_per_node
    offloads = [(False, False), (False, True), (True, True)] if critic else [(False, False), (True, False)]
    out = []
    for tp, pp, cp in itertools.product(_powers(per_node), (1, 2, 4, 8), (1, 2, 4)):
        mp = tp * pp * cp
        if mp > world or world % mp or arch.layers % pp or arch.heads % tp or arch.kv_heads % tp:
            continue
        eps = [e for e in _powers(world // pp) if arch.num_experts % e == 0 and world % (e * pp) == 0] \
            if arch.num_experts else [1]
        for ep, (actor_off, critic_off) in itertools.product(eps, offloads):
            s = {"parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp, "parallel.ep": ep,
                 "parallel.etp": 1 if arch.num_experts else None, "model.sequence_parallel": tp > 1,
                 "actor.offload_optimizer": actor_off}
            if critic:
                s["critic.offload_optimizer"] = critic_off
            out.append(s)
    return out


ROLLOUT_PROBLEMS = ("rollout", "parallel.rollout_tp", "weight sync")


def _rollout_ok(pl: Plan) -> bool:
    return pl.rollout_peak <= pl.gpu.mem_bytes and not any(p.startswith(ROLLOUT_PROBLEMS[:2]) for p in pl.problems)


def _train_ok(pl: Plan) -> bool:
    return pl.train_peak <= pl.gpu.mem_bytes and all(p.startswith(ROLLOUT_PROBLEMS) for p in pl.problems)


def search(cfgs: list[MegaRLConfig], arch: Arch, hf: dict, gpu: GPU, top: int = 5,
           max_engine_nodes: int = MAX_ENGINE_NODES, weights_dtypes: tuple[str, ...] = ("bf16", "fp8"),
           **plan_args: Any) -> list[Candidate]:
    """The `top` best layouts that fit every config of `cfgs` (one per recipe, on the same nodes),
    ranked by the first's planned step (module doc)."""
    base = cfgs[0]
    rollouts = []
    for s in rollout_space(base, arch, max_engine_nodes, weights_dtypes):
        pl = plan(apply(base, s), arch, hf, gpu, **plan_args)
        if _rollout_ok(pl):
            rollouts.append((pl.time["rollout_s"], s))
    rollouts.sort(key=lambda x: (x[0], x[1]["rollout.sync_from_host"]))
    critic = any(c.critic.enable for c in cfgs)
    trains = [s for s in train_space(base, arch, critic) if all(_train_ok(plan(apply(c, s), arch, hf, gpu, **plan_args))
                                                        for c in cfgs)]
    found = []
    for (_, rs), ts in itertools.product(rollouts[:ROLLOUT_SHORTLIST], trains):
        settings = {**ts, **rs}
        plans = [plan(apply(c, settings), arch, hf, gpu, **plan_args) for c in cfgs]
        if all(pl.fits for pl in plans):
            found.append(Candidate(settings, plans, base.parallel.gpus_per_node))
    best = min((c.step_s for c in found), default=1.0)
    found.sort(key=lambda c: (math.floor(c.step_s / (STEP_TIE * best)), c.tie_break()))
    return found[:top]


def format_search(found: list[Candidate], recipes: list[str]) -> str:
    from megarl.planner.arch import GIB

    if not found:
        return "no layout fits (try more nodes or GPUs with more memory; `megarl plan` on one layout says why)"
    lines = [f"best {len(found)} layouts by the planned step of {recipes[0]}"
             + (f" (fitting {', '.join(recipes[1:])} too)" if len(recipes) > 1 else ""),
             "| # | train tp/pp/cp/ep, optimizer offload | rollout_tp / dp attn / ep, weights, mem_fraction, "
             "sync from host | rollout / sync / train peak (GiB) | rollout | train | step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, c in enumerate(found, 1):
        s, pl = c.settings, c.plans[0]
        off = "actor" if s["actor.offload_optimizer"] else ""
        if s.get("critic.offload_optimizer"):
            off = (off + "+critic") if off else "critic"
        lines.append(
            f"| {i} | {s['parallel.tp']}/{s['parallel.pp']}/{s['parallel.cp']}/{s['parallel.ep']}, {off or 'none'} | "
            f"{s['parallel.rollout_tp']} / {s['rollout.sglang_dp_size']} / {s['rollout.sglang_ep_size']}"
            f"{' deepep' if s['rollout.sglang_server_args'].get('moe_a2a_backend') == 'deepep' else ''}, "
            f"{'fp8 checkpoint' if pl.arch.fp8 else s['rollout.weights_dtype']}, {s['rollout.mem_fraction']}, {'yes' if s['rollout.sync_from_host'] else 'no'} | "
            f"{pl.rollout_peak / GIB:.1f} / {pl.sync_peak / GIB:.1f} / {max(p.train_peak for p in c.plans) / GIB:.1f} | "
            f"{pl.time['rollout_s'] / 60:.1f} min | {pl.time['train_s'] / 60:.1f} min | {pl.time['step_s'] / 60:.1f} min |")
    return "\n".join(lines)


def layout_yaml(found: Candidate, base_layout: dict, recipes: list[str], command: str, gpu_name: str) -> str:
    """The chosen layout as a layout file: `base_layout` (the layout searched from, parsed YAML)
    with the searched settings written over it, under a header that says how it was chosen."""
    import copy

    import yaml

    from megarl.planner.arch import GIB

    out = copy.deepcopy(base_layout)
    out.pop("defaults", None)
    for key, value in found.settings.items():
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = value
    pl, s = found.plans[0], found.settings
    p = pl.world
    header = [
        f"Chosen by `megarl plan --search` on {gpu_name} for {', '.join(recipes)}: {p} GPUs.",
        f"Planned step {pl.time['step_s'] / 60:.1f} min (rollout {pl.time['rollout_s'] / 60:.1f}, train "
        f"{pl.time['train_s'] / 60:.1f}, host copies {pl.time['host_s'] / 60:.1f}); peaks over the recipes: "
        f"{found.peak / GIB:.1f} GiB of {pl.gpu.mem_bytes / GIB:.1f}.",
        f"Engines of {s['parallel.rollout_tp']} GPUs: attention over {s['rollout.sglang_dp_size']} group(s), "
        f"experts over {s['rollout.sglang_ep_size']} GPU(s), {s['rollout.weights_dtype']} weights.",
        f"Regenerate: {command}",
    ]
    body = yaml.safe_dump(out, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" for line in header) + body
