"""The planner's rollout engine (megarl/planner/engine.py: DP attention, EP, engines over nodes,
FP8 weights) against hand-computed figures, and `megarl plan --search` (megarl/planner/search.py):
its choice is the best candidate it plans, the layout file it writes loads and plans the same."""

from __future__ import annotations

import json
import os

import pytest

from megarl import planner as plan
from megarl.config import load_config
from megarl.planner import engine
from megarl.planner.engine import EngineShape
from megarl.planner.search import apply, rollout_space, search

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


def arch_of(name: str) -> plan.Arch:
    with open(os.path.join(CONFIGS, "models", f"{name}.json")) as f:
        return plan.Arch.from_hf(json.load(f))


Q235 = arch_of("qwen3-235b-a22b")  # 94 layers, hidden 4096, 64 heads / 4 KV heads of 128, 128 experts top-8
# attention projections of one layer: q and o (4096 x 64*128 each), k and v (4096 x 4*128 each)
Q235_ATTN = 94 * (2 * 4096 * 64 * 128 + 2 * 4096 * 4 * 128)


def test_engine_weights_replicate_attention_over_dp_groups():
    one = EngineShape(tp=8)
    assert engine.attention_params(Q235) == Q235_ATTN
    assert engine.weight_bytes(Q235, one) == pytest.approx(2 * Q235.total_params() / 8)  # plain TP: all / T
    for dp in (2, 8):  # attention on 8 / dp GPUs, the rest over all 8
        extra = engine.weight_bytes(Q235, EngineShape(tp=8, dp=dp, ep=8)) - engine.weight_bytes(Q235, one)
        assert extra == pytest.approx(2 * Q235_ATTN * (dp / 8 - 1 / 8))
    fp8 = engine.weight_bytes(Q235, EngineShape(tp=8, fp8=True))
    emb = 2 * 151936 * 4096
    assert fp8 == pytest.approx(((Q235.total_params() - emb) * (1 + 4 / 128**2) + 2 * emb) / 8)


def test_kv_cache_grows_with_attention_groups():
    pool = 40 * 2**30
    per_head_token = 2 * 94 * 128 * 2  # K and V, every layer, one KV head, bf16
    # TP 8 over 4 KV heads: each GPU keeps one (duplicated) head of every sequence
    assert engine.kv_tokens(Q235, EngineShape(tp=8), pool) == pytest.approx(pool / per_head_token)
    # 2 groups of 4 GPUs: one head per GPU, each group its own sequences -> twice the tokens
    assert engine.kv_tokens(Q235, EngineShape(tp=8, dp=2, ep=8), pool) == pytest.approx(2 * pool / per_head_token)
    # 8 groups of one GPU: all 4 heads per GPU, 8 groups -> also twice
    assert engine.kv_tokens(Q235, EngineShape(tp=8, dp=8, ep=8), pool) == pytest.approx(8 * pool / (4 * per_head_token))


def test_decode_step_communication():
    b, h = 256, 4096
    # plain TP inside a node: two ring all-reduces of B x h bf16 per layer over NVLink
    ar = engine.NVLINK_LATENCY_S + 2 * 7 / 8 * b * h * 2 / engine.NVLINK_BYTES_PER_S
    assert engine.comm_s(Q235, EngineShape(tp=8), b) == pytest.approx(94 * 2 * ar)
    # DP attention over 4 nodes with DeepEP: per MoE layer two all-to-alls of B/T tokens x top-8 over InfiniBand
    e = EngineShape(tp=32, dp=32, ep=32, deepep=True)
    a2a = engine.IB_LATENCY_S + b / 32 * h * 2 * 8 / engine.IB_BYTES_PER_S
    assert engine.comm_s(Q235, e, b) == pytest.approx(94 * 2 * a2a)
    # ... without DeepEP: an all-gather and a reduce-scatter of the engine's tokens
    ag = engine.IB_LATENCY_S + b * h * 2 * 31 / 32 / engine.IB_BYTES_PER_S
    assert engine.comm_s(Q235, EngineShape(tp=32, dp=32, ep=32), b) == pytest.approx(94 * 2 * ag)
    assert engine.comm_s(Q235, EngineShape(tp=1), b) == 0.0
    step = engine.decode_step(Q235, EngineShape(tp=8), plan.GPUS["h100"], b, 1000.0, 0.6)
    assert step["step_s"] == pytest.approx(max(step["mem_s"], step["flops_s"]) + step["comm_s"])


def recipes(model: str, *names: str) -> list[str]:
    return [os.path.join(CONFIGS, "recipes", model, f"{n}.yaml") for n in names]


def test_search_returns_the_best_candidate_it_plans():
    layout = os.path.join(CONFIGS, "layouts", "qwen3-30b-a3b", "4node.yaml")
    cfgs = [load_config([r, layout]) for r in recipes("qwen3-30b-a3b", "dapo", "vapo")]
    arch, hf, _ = plan.load_arch(cfgs[0])
    gpu = plan.GPUS["h100"]
    found = search(cfgs, arch, hf, gpu, top=3)
    assert found and all(all(p.fits for p in c.plans) for c in found)
    best = found[0]
    # no rollout setting, with the chosen training layout, plans a step more than 1% shorter
    train = {k: v for k, v in best.settings.items() if not k.startswith("rollout.") and k != "parallel.rollout_tp"}
    for rs in rollout_space(cfgs[0], arch):
        settings = {**train, **rs}
        plans = [plan.plan(apply(c, settings), arch, hf, gpu) for c in cfgs]
        if all(p.fits for p in plans):
            assert plans[0].time["step_s"] >= 0.99 * best.step_s, settings
    # the old hand-made layout plans a longer step
    assert plan.plan(cfgs[0], arch, hf, gpu).time["step_s"] > best.step_s


def test_search_cli_writes_a_layout_that_plans_the_same(tmp_path, capsys):
    import yaml

    out = tmp_path / "4node.yaml"
    rec = recipes("qwen3-30b-a3b", "dapo", "vapo")
    # start from a hand-made layout unlike the search's choice (the shipped one is that choice)
    with open(os.path.join(CONFIGS, "layouts", "qwen3-30b-a3b", "4node.yaml")) as f:
        hand = yaml.safe_load(f)
    hand["parallel"].update(tp=4, pp=1, cp=1, ep=8, rollout_tp=4)
    hand["rollout"].update(sglang_dp_size=1, sglang_ep_size=1, mem_fraction=0.7)
    for role in ("actor", "critic"):
        hand[role]["offload_optimizer"] = True
    layout = str(tmp_path / "hand.yaml")
    with open(layout, "w") as f:
        yaml.safe_dump(hand, f)
    rc = plan.main(["--search", "--recipe", rec[0], "--fit-also", rec[1], "--layout", layout, "--top", "2",
                    "--weights-dtypes", "bf16", "--write", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "| 1 |" in printed and "| 2 |" in printed and f"wrote {out}" in printed
    text = out.read_text()
    assert text.startswith("# Chosen by `megarl plan --search`") and "--weights-dtypes bf16" in text
    cfgs = [load_config([r, str(out)]) for r in rec]
    arch, hf, _ = plan.load_arch(cfgs[0])
    best = search([load_config([r, layout]) for r in rec], arch, hf, plan.GPUS["h100"], top=1,
                  weights_dtypes=("bf16",))[0]
    written = plan.plan(cfgs[0], arch, hf, plan.GPUS["h100"])
    assert written.fits and written.time["step_s"] == pytest.approx(best.step_s)
    assert plan.plan(load_config([rec[0], layout]), arch, hf, plan.GPUS["h100"]).time["step_s"] > 1.1 * best.step_s
    assert cfgs[0].rollout.weights_dtype == "bf16"
    with pytest.raises(SystemExit):
        plan.main(["--recipe", rec[0], "--write", str(out)])  # --write goes with --search
    assert plan.main(["--search", "--recipe", rec[0], "--weights-dtypes", "int4"]) == 2


def test_shipped_moe_layouts_meet_their_planned_targets():
    # docs/cluster.md: Qwen3-235B-A22B DAPO on 16 nodes <= 120 min, Qwen3-30B-A3B DAPO on 4 nodes <= 60 min (H100)
    for model, nodes, target_min in (("qwen3-235b-a22b", 16, 120), ("qwen3-30b-a3b", 4, 60)):
        cfg = load_config([recipes(model, "dapo")[0], os.path.join(CONFIGS, "layouts", model, f"{nodes}node.yaml")])
        arch, hf, _ = plan.load_arch(cfg)
        pl = plan.plan(cfg, arch, hf, plan.GPUS["h100"])
        assert pl.fits and pl.time["step_s"] / 60 <= target_min, (model, pl.time["step_s"] / 60)
