"""megarl.planner (`megarl plan`): the memory model against first principles, and every shipped layout fits."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from megarl.config import load_config
from megarl.config.loader import from_dict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


from megarl import planner as plan  # noqa: E402
GIB = 1024**3


def hf_json(name: str) -> dict:
    with open(os.path.join(CONFIGS, "models", f"{name}.json")) as f:
        return json.load(f)


def plan_cli(capsys, model: str, algo: str, layout: str | None, *args: str) -> tuple[int, str]:
    """The planner's command line on configs/recipes/<model>/<algo>.yaml (and the layout
    configs/layouts/<model>/<layout>.yaml when given) with `args`: its exit code and what it printed."""
    argv = ["--recipe", os.path.join(CONFIGS, "recipes", model, f"{algo}.yaml")]
    if layout:
        argv += ["--layout", os.path.join(CONFIGS, "layouts", model, f"{layout}.yaml")]
    rc = plan.main(argv + list(args))
    return rc, capsys.readouterr().out


QWEN32 = plan.Arch.from_hf(hf_json("qwen2.5-32b"))
QWEN7 = plan.Arch.from_hf(hf_json("qwen2.5-7b"))


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_hf_model(tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = dict(hidden_size=96, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2,
              num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=tie, model_type="qwen2")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**hf))
    expected = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert plan.Arch.from_hf(hf).total_params() == expected


def test_qwen_sizes():
    # Qwen2ForCausalLM built from these config.json files on the meta device has exactly these counts
    assert QWEN7.total_params() == 7_615_616_512
    assert QWEN32.total_params() == 32_763_876_352


def test_stage_params_shard_by_tp_and_pp():
    a = QWEN32
    h, v, L = a.hidden, a.vocab, a.layers
    per_layer = a.layer_params()
    # TP=8: matrices and biases split 8 ways, the two RMSNorm weights (2h) replicated,
    # embedding and LM head vocab-parallel, final norm replicated
    assert a.stage_params(8, 1) == L * ((per_layer - 2 * h) // 8 + 2 * h) + 2 * v * h // 8 + h
    # PP=2: the first stage holds the embedding, the last the final norm + LM head; same size here
    first = L // 2 * ((per_layer - 2 * h) // 8 + 2 * h) + v * h // 8
    assert a.stage_params(8, 2) == first + h
    # a critic swaps the LM head (V x h) for a scalar value head (h + 1)
    assert a.stage_params(8, 1, value_head=True) == a.stage_params(8, 1) - v * h // 8 + h + 1


def test_weights_are_two_bytes_per_param_and_adam_twelve_over_dp():
    cfg = load_config(None, ["model.name=qwen2.5-32b", "parallel.tp=1", "parallel.nodes=1", "parallel.gpus_per_node=8"])
    (actor,) = plan.model_states(QWEN32, cfg, world=8)
    assert actor.weights == 2 * 32_763_876_352           # bf16 weights of the whole 32B model
    assert actor.grads == 4 * 32_763_876_352  # float32: megatron DDP reduces gradients in fp32 (grad_reduce_in_fp32)
    assert actor.optimizer == 12 * 32_763_876_352 / 8    # fp32 master + m + v, sharded over DP=8

    # a CP layout: the distributed optimizer shards over DP x CP
    cfg = from_dict({"parallel": {"tp": 8, "cp": 2, "nodes": 16}}, validate=False)
    (actor,) = plan.model_states(QWEN32, cfg, world=128)
    n = QWEN32.stage_params(8, 1)
    assert actor.weights == 2 * n
    assert actor.optimizer == 12 * n / 16                # DP=8 x CP=2: the optimizer shards over both

    cfg = load_config(None, ["parallel.tp=8", "actor.use_distributed_optimizer=false"])
    (actor,) = plan.model_states(QWEN32, cfg, world=128)
    assert actor.optimizer == 12 * n                      # replicated without the distributed optimizer

    ref_cfg = load_config(None, ["parallel.tp=8", "algorithm.kl_coef=0.001", "critic.enable=true"])
    roles = {s.role: s for s in plan.model_states(QWEN32, ref_cfg, world=128)}
    assert set(roles) == {"actor", "critic", "reference"}
    assert roles["reference"].weights == 2 * n and roles["reference"].optimizer == 0


# ----------------------------------------------------------------------------- activations


GPT_LIKE = plan.Arch(hidden=768, layers=4, heads=12, kv_heads=12, head_dim=64, ffn=2048,  # 6f = 16h
                     vocab=1000, tie_embeddings=False, qkv_bias=False, qk_norm=False)


def korthikanti_per_layer(s: int, h: int, a: int, t: int, sp: bool, selective: bool) -> float:
    """Korthikanti et al. 2022, Table 2 (bytes per layer, micro-batch b = 1), dropout masks included."""
    if selective:
        return s * h * 34 / t if sp else s * h * (10 + 24 / t)
    return s * h * (34 / t + 5 * a * s / (h * t)) if sp else s * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("tp, sp, recompute", [(1, False, None), (4, False, None), (4, True, None), (4, True, "selective"), (2, False, "selective")])
def test_activation_formula_reduces_to_korthikanti(tp, sp, recompute):
    s = 1024
    # megatron's unfused attention (Korthikanti's [s, s] scores); without validation, as the trainer
    # would refuse SP on a CPU-only config
    cfg = from_dict({"parallel": {"tp": tp}, "model": {"sequence_parallel": sp, "transformer_impl": "transformer_engine",
                                                       "attention_backend": "unfused", "recompute": recompute},
                     "data": {"max_prompt_len": 24}, "rollout": {"max_new_tokens": 1000},
                     "actor": {"max_tokens_per_microbatch": s}}, validate=False)
    got = plan.activation_bytes_per_token_layer(GPT_LIKE, cfg, seq_len=s) * s
    h = GPT_LIKE.hidden
    masks = 2 * s * h / (tp if sp else 1)  # Qwen has dropout 0: the planner drops the two dropout masks
    assert got == pytest.approx(korthikanti_per_layer(s, h, GPT_LIKE.heads, tp, sp, recompute == "selective") - masks)


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    cfg = load_config(None, ["model.name=qwen2.5-32b", "parallel.tp=8", "model.sequence_parallel=true",
                             "model.recompute=full", "actor.max_tokens_per_microbatch=32768"])
    acts = plan.activation_bytes(QWEN32, cfg, "actor")
    s, h = 32768, QWEN32.hidden
    one_layer = s * plan.activation_bytes_per_token_layer(QWEN32, cfg, seq_len=22528)
    assert acts["layers"] == pytest.approx(64 * s * 2 * h / 8 + one_layer)
    # bf16 logits + bf16 gradient of the whole micro-batch, fp32 logits / softmax / gradient of one chunk
    assert acts["logits"] == s * QWEN32.vocab / 8 * 4 + 4096 * QWEN32.vocab / 8 * 12
    assert plan.activation_bytes(QWEN32, cfg, "critic")["logits"] == 0


def test_kv_cache_bytes_per_token():
    assert QWEN32.kv_bytes_per_token(1) == 2 * 64 * 8 * 128 * 2    # 256 KiB per token unsharded
    assert QWEN32.kv_bytes_per_token(8) == 2 * 64 * 1 * 128 * 2
    assert QWEN7.kv_bytes_per_token(8) == 2 * 28 * 1 * 128 * 2     # 4 KV heads replicated over 8 ranks


# Qwen2.5-32B per token and layer with SP over TP=8 and no core-attention term (selective recompute):
# (8h + 4ad + 4gd + 6f) / 8 = (40960 + 20480 + 4096 + 165888) / 8 bytes
QWEN32_SP8_SELECTIVE = 28928
QWEN32_VOCAB_TP8 = 152064 / 8


def long_cfg(*overrides: str):
    return load_config(None, ["model.name=qwen2.5-32b", "parallel.tp=8", "parallel.nodes=16",
                              "model.transformer_impl=transformer_engine", "model.sequence_parallel=true",
                              "data.max_prompt_len=2048", "rollout.max_new_tokens=61440", *overrides])


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_cp_divides_activations_per_rank(cp):
    B = 65536
    cfg = long_cfg("model.recompute=selective", f"parallel.cp={cp}", f"actor.max_tokens_per_microbatch={B}")
    acts = plan.activation_bytes(QWEN32, cfg, "actor")
    s = B // cp  # tokens of the micro-batch on one GPU
    assert acts["layers"] == 64 * s * QWEN32_SP8_SELECTIVE
    # TE's ring attention: about two chunks of K and V in flight (1 KV head per GPU, head_dim 128, bf16)
    assert acts["kv_exchange"] == (0 if cp == 1 else 2 * 2 * s * 1 * 128 * 2)
    assert acts["workspace"] == 0
    assert acts["logits"] == s * QWEN32_VOCAB_TP8 * 4 + 4096 * QWEN32_VOCAB_TP8 * 12
    one = plan.activation_bytes(QWEN32, long_cfg("model.recompute=selective", f"actor.max_tokens_per_microbatch={B}"),
                                "actor")
    assert acts["total"] == pytest.approx(one["total"] / cp, rel=0.1)  # ~1/CP; the one log-prob chunk does not shrink


def test_te_ring_cp_keeps_two_kv_chunks_in_flight():
    B, cp = 65536, 4
    p2p = plan.activation_bytes(QWEN32, long_cfg(f"parallel.cp={cp}", f"actor.max_tokens_per_microbatch={B}"), "actor")
    assert p2p["kv_exchange"] == 2 * 2 * (B // cp) * 1 * 128 * 2


def test_local_cp_attention_keeps_its_prefix_kv_of_every_layer():
    """bf16: the varlen path keeps each local chunk's prefix keys ((2CP+1)/(2CP) x the gathered
    K/V), its bf16 output and fp32 log-sum-exp, and no score workspace."""
    B, cp, tp = 32768, 4, 2
    base = ["model.name=qwen2.5-32b", "model.transformer_impl=local", f"parallel.tp={tp}", f"parallel.cp={cp}",
            "parallel.nodes=1", "parallel.gpus_per_node=8", "data.max_prompt_len=2048", "rollout.max_new_tokens=30000",
            f"actor.max_tokens_per_microbatch={B}"]
    acts = plan.activation_bytes(QWEN32, load_config(None, base), "actor")
    s = B // cp
    # no SP: 8h replicated + (4ad + 4gd + 6f + bf16 output 2ad + fp32 log-sum-exp 4a) / TP
    per_token = 40960 + (20480 + 4096 + 165888 + 10240 + 160) / tp
    gathered_kv = 2 * B * (8 // tp) * 128 * 2  # full-sequence K and V of the local KV heads, bf16
    prefixes = gathered_kv * 9 / 8  # chunks r and 7-r of every sequence over their prefixes: 9/8 of the rows
    assert acts["kv_exchange"] == 64 * prefixes + gathered_kv
    assert acts["layers"] == 64 * s * per_token
    assert acts["workspace"] == 0
    sel = plan.activation_bytes(QWEN32, load_config(None, base + ["model.recompute=selective"]), "actor")
    assert sel["kv_exchange"] == gathered_kv + prefixes  # one layer's worth, recomputed in the backward
    assert sel["layers"] == 64 * s * (40960 + (20480 + 4096 + 165888) / tp)


def test_local_cp_blockwise_attention_keeps_the_gathered_kv_of_every_layer():
    """fp32: the blockwise path keeps the gathered K/V, its fp32 output and log-sum-exp, and one
    query block's fp32 scores, probabilities, dP and dS as workspace."""
    B, cp, tp = 32768, 4, 2
    base = ["model.name=qwen2.5-32b", "model.transformer_impl=local", "model.dtype=fp32", f"parallel.tp={tp}",
            f"parallel.cp={cp}", "parallel.nodes=1", "parallel.gpus_per_node=8", "data.max_prompt_len=2048",
            "rollout.max_new_tokens=30000", f"actor.max_tokens_per_microbatch={B}"]
    acts = plan.activation_bytes(QWEN32, load_config(None, base), "actor")
    s = B // cp
    per_token = 40960 + (20480 + 4096 + 165888 + 20480 + 160) / tp
    gathered_kv = 2 * B * (8 // tp) * 128 * 4  # fp32
    assert acts["kv_exchange"] == 64 * gathered_kv
    assert acts["layers"] == 64 * s * per_token
    # the local attention's query block: 32 MiB / (4 bytes x 20 heads x 32768 keys) = 12 -> its minimum, 16
    assert acts["workspace"] == 16 * 16 * 32048 * 40 / tp  # fp32 scores, P, dP, dS of 16 queries x 32,048 keys
    sel = plan.activation_bytes(QWEN32, load_config(None, base + ["model.recompute=selective"]), "actor")
    assert sel["kv_exchange"] == gathered_kv  # gathered again in the backward: one layer's worth at a time
    attention = sys.modules[plan.activation_bytes.__module__]
    assert attention.LOCAL_SCORE_BLOCK_BYTES == pytest.importorskip("megarl.models.attention_blockwise").SCORE_BLOCK_BYTES


def test_logprob_chunk_bounds_the_float32_logits():
    s = 16384
    acts = {c: plan.activation_bytes(QWEN32, long_cfg("model.recompute=selective", "parallel.cp=4",
                                                      f"actor.max_tokens_per_microbatch={4 * s}",
                                                      f"model.logprob_chunk_tokens={c}"), "actor")["logits"]
            for c in (1024, 4096, 10**6)}
    assert acts[4096] - acts[1024] == (4096 - 1024) * QWEN32_VOCAB_TP8 * 12
    assert acts[10**6] == s * QWEN32_VOCAB_TP8 * (4 + 12)  # a chunk larger than the micro-batch: the whole of it
    assert acts[4096] < s * QWEN32_VOCAB_TP8 * 10  # less than float32 logits + gradient of every token


def test_train_flops_formula():
    cfg = load_config(os.path.join(CONFIGS, "recipes", "qwen2.5-32b", "dapo.yaml"))
    t = plan.step_time(cfg, QWEN32, plan.GPUS["h100"], 128, kv_tokens=1e6, avg_prompt_len=200,
                       avg_response_len=1800, mfu=0.5, decode_eff=0.6, gen_rounds=1)
    tokens = 512 * 16 * 2000
    per_token_fwd = 2 * 32_763_876_352 + 4 * 64 * 40 * 128 * 1000   # 2N + causal attention at mean context 1000
    passes = 1 + 4  # old log-probs + training (full recompute in the 16-node layout: 4 passes)
    assert t["train_tokens"] == tokens
    assert t["train_flops"] == pytest.approx(per_token_fwd * tokens * passes)
    assert t["train_s"] == pytest.approx(t["train_flops"] / (128 * 989e12 * 0.5))


# ----------------------------------------------------------------------------- shipped layouts


LAYOUTS = sorted(glob.glob(os.path.join(CONFIGS, "layouts", "*", "*node.yaml")))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: os.path.relpath(p, CONFIGS))
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_every_shipped_layout_fits_every_recipe_of_its_model(layout, gpu):
    model = os.path.basename(os.path.dirname(layout))
    recipes = sorted(glob.glob(os.path.join(CONFIGS, "recipes", model, "*.yaml")))
    assert recipes
    for recipe in recipes:
        cfg = load_config([recipe, layout])
        arch, hf, _ = plan.load_arch(cfg)
        pl = plan.plan(cfg, arch, hf, plan.GPUS[gpu])
        assert pl.fits, f"{recipe} + {layout} on {gpu}: {pl.problems}"
        assert max(pl.rollout_peak, pl.sync_peak, pl.train_peak) <= pl.gpu.mem_bytes


ONE_NODE_ENGINE = ["parallel.rollout_tp=8", "rollout.sglang_dp_size=1", "rollout.sglang_ep_size=1",
                   "rollout.sglang_server_args={}"]


@pytest.mark.parametrize("model, fix", [("deepseek-v3", "raise parallel.rollout_tp (whole nodes with rollout.engine=sglang)"),
                                        ("kimi-k2", "raise parallel.rollout_tp"),
                                        ("glm-4.5", "serve FP8 weights: rollout.weights_dtype=fp8")])
def test_a_model_too_big_for_a_one_node_engine_is_told_what_fits(model, fix):
    # the shipped layouts run these models on engines of 4 nodes; on one node's 8 H100s the engine's
    # weights leave no KV cache, and the planner says which settings help
    recipe = os.path.join(CONFIGS, "recipes", model, "dapo.yaml")
    layout = sorted(glob.glob(os.path.join(CONFIGS, "layouts", model, "*node.yaml")))[0]
    cfg = load_config([recipe, layout], ONE_NODE_ENGINE)
    arch, hf, _ = plan.load_arch(cfg)
    pl = plan.plan(cfg, arch, hf, plan.GPUS["h100"])
    assert not pl.fits and any("leaving no KV cache" in p and fix in p for p in pl.problems), pl.problems
    assert plan.plan(load_config([recipe, layout]), arch, hf, plan.GPUS["h100"]).fits


def test_layout_set():
    names = {os.path.relpath(p, os.path.join(CONFIGS, "layouts")) for p in LAYOUTS}
    assert {f"qwen2.5-7b/{n}node.yaml" for n in (1, 2, 4, 8, 16, 32, 64)} <= names
    assert {f"qwen2.5-32b/{n}node.yaml" for n in (2, 4, 8, 16, 32, 64)} <= names
    assert {f"qwen3-30b-a3b/{n}node.yaml" for n in (1, 2, 4, 8)} <= names
    assert {f"qwen3-235b-a22b/{n}node.yaml" for n in (16, 32, 64)} <= names
    assert {f"{m}/{n}node.yaml" for m in ("deepseek-v3", "kimi-k2") for n in (32, 64, 128)} <= names
    assert {f"{m}/{n}node.yaml" for m in ("glm-4.5", "glm-4.5-fp8") for n in (16, 32)} <= names
    assert {"glm-4.5-air/4node.yaml", "glm-4.5-air/8node.yaml"} <= names
    assert {"qwen3.5-35b-a3b/2node.yaml", "qwen3.5-35b-a3b/4node.yaml"} <= names
    assert {f"{m}/{n}node.yaml" for m in ("qwen3.5-397b-a17b", "qwen3.5-397b-a17b-fp8") for n in (16, 32)} <= names
    long = {os.path.relpath(p, os.path.join(CONFIGS, "layouts")) for p in LONG_LAYOUTS}
    assert {f"qwen2.5-32b/16node-{k}k.yaml" for k in (20, 32, 64)} <= long


LONG_LAYOUTS = sorted(glob.glob(os.path.join(CONFIGS, "layouts", "*", "*node-*k.yaml")))
QWEN32_RECIPES = sorted(glob.glob(os.path.join(CONFIGS, "recipes", "qwen2.5-32b", "*.yaml")))


@pytest.mark.parametrize("layout", LONG_LAYOUTS, ids=lambda p: os.path.relpath(p, CONFIGS))
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_long_context_layouts_fit_every_recipe(layout, gpu):
    k = int(os.path.basename(layout).split("-")[1].removesuffix("k.yaml"))
    assert QWEN32_RECIPES
    for recipe in QWEN32_RECIPES:
        cfg = load_config([recipe, layout])
        assert cfg.rollout.max_new_tokens == cfg.eval.max_new_tokens == k * 1024
        assert cfg.parallel.cp > 1 and cfg.model.recompute == "selective"
        arch, hf, _ = plan.load_arch(cfg)
        pl = plan.plan(cfg, arch, hf, plan.GPUS[gpu])
        assert pl.fits, f"{recipe} + {layout} on {gpu}: {pl.problems}"
        assert max(pl.rollout_peak, pl.train_peak) <= pl.gpu.mem_bytes


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_64k_layout_without_cp_is_rejected_naming_the_cause(gpu, capsys):
    recipe = os.path.join(CONFIGS, "recipes", "qwen2.5-32b", "dapo.yaml")
    layout = os.path.join(CONFIGS, "layouts", "qwen2.5-32b", "16node-64k.yaml")
    cfg = load_config([recipe, layout], ["parallel.cp=1"])
    pl = plan.plan(cfg, QWEN32, hf_json("qwen2.5-32b"), plan.GPUS[gpu])
    (msg,) = [p for p in pl.problems if p.startswith("train phase needs")]
    # 69,632 tokens per GPU x 64 layers x 28,928 bytes = 120.1 GiB of layer activations
    assert "at 69,632 tokens per GPU" in msg and "layers 120.1" in msg
    assert "the largest term is layer activations (120.1 GiB)" in msg and "parallel.cp" in msg
    rc = plan.main(["--recipe", recipe, "--layout", layout, "--gpu", gpu, "parallel.cp=1"])
    assert rc == 1 and "the largest term is layer activations" in capsys.readouterr().out


def test_planner_reports_what_does_not_fit():
    recipe = os.path.join(CONFIGS, "recipes", "qwen2.5-32b", "vapo.yaml")
    # one node, no recompute, no offload: optimizer + activations overflow 80 GB
    cfg = load_config(recipe, ["parallel.nodes=1", "model.recompute=null"])
    pl = plan.plan(cfg, QWEN32, hf_json("qwen2.5-32b"), plan.GPUS["h100"])
    assert not pl.fits and any(p.startswith("train phase needs") for p in pl.problems)
    # the engine's share too small for one 22.5K-token sequence next to the weights
    cfg = load_config(recipe, ["rollout.mem_fraction=0.1", "parallel.rollout_tp=1"])
    pl = plan.plan(cfg, QWEN32, hf_json("qwen2.5-32b"), plan.GPUS["h100"])
    assert any("KV cache" in p for p in pl.problems)
    # a layout whose heads do not divide by TP is reported, not crashed on
    cfg = load_config(recipe, ["parallel.tp=3", "parallel.nodes=3"])
    pl = plan.plan(cfg, QWEN32, hf_json("qwen2.5-32b"), plan.GPUS["h100"])
    assert any("not divisible by tp=3" in p for p in pl.problems)


def test_cli(capsys):
    ok, out = plan_cli(capsys, "qwen2.5-32b", "dapo", "16node", "--nodes", "16")
    assert ok == 0 and "FITS" in out and "dp=16" in out and "rollout phase peak" in out
    bad, out = plan_cli(capsys, "qwen2.5-32b", "dapo", None, "--nodes", "1", "model.recompute=null",
                        "actor.offload_optimizer=false")
    assert bad == 1 and "DOES NOT FIT" in out


# ----------------------------------------------------------------------------- mixture of experts


QWEN3_30B = plan.Arch.from_hf(hf_json("qwen3-30b-a3b"))
QWEN3_235B = plan.Arch.from_hf(hf_json("qwen3-235b-a22b"))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_param_count_matches_hf_model(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, num_hidden_layers=3, vocab_size=1000, num_experts=6,
              num_experts_per_tok=2, tie_word_embeddings=False, model_type=family)
    if family == "qwen2_moe":
        hf["shared_expert_intermediate_size"] = 40
    config_cls = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.Qwen2MoeConfig
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**{k: v for k, v in hf.items() if k != "model_type"}))
    arch = plan.Arch.from_hf(hf)
    assert arch.total_params() == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert arch.layers * arch.expert_layer_params() == experts
    # a token passes through 2 of the 6 experts of every layer
    assert arch.active_params() == arch.total_params() - experts * 4 // 6


def test_qwen3_moe_sizes():
    # Qwen3-30B-A3B by hand: attention 2*2048*4096 + 2*2048*4*128, q/k norms 2*128, norms 2*2048,
    # router 128*2048, experts 128 * 3*2048*768 per layer; untied 151936 x 2048 embedding and head
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 256 + 4096 + 128 * 2048 + 128 * 3 * 2048 * 768
    assert QWEN3_30B.total_params() == 48 * layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    assert QWEN3_30B.active_params() == 30_532_122_624 - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    layer = 2 * 4096 * 8192 + 2 * 4096 * 512 + 256 + 8192 + 128 * 4096 + 128 * 3 * 4096 * 1536
    assert QWEN3_235B.total_params() == 94 * layer + 2 * 151936 * 4096 + 4096 == 235_093_634_560
    assert QWEN3_235B.active_params() == 235_093_634_560 - 94 * 120 * 3 * 4096 * 1536


def test_moe_weights_shard_over_ep_and_optimizer_over_expert_dp():
    a = QWEN3_30B
    # TP=2, EP=8, expert-TP 1 on 64 GPUs: dense DP x CP = 64 / 2 = 32, expert DP = 64 / (1 * 8 * 1) = 8
    cfg = load_config(None, ["model.name=qwen3-30b-a3b", "parallel.tp=2", "parallel.ep=8", "parallel.etp=1",
                             "parallel.nodes=8", "model.sequence_parallel=true",
                             "model.transformer_impl=transformer_engine"])
    (actor,) = plan.model_states(a, cfg, world=64)
    experts = 48 * 128 * 3 * 2048 * 768 // 8                       # 16 whole experts of every layer
    replicated = 2 * 2048 + 256 + 128 * 2048                          # norms, q/k norms, router
    dense = 48 * ((2 * 2048 * 4096 + 2 * 2048 * 512) / 2 + replicated) + 151936 * 2048 / 2 * 2 + 2048
    assert a.stage_expert_params(1, 8, 1) == experts == 3_623_878_656
    assert actor.params_gpu == int(dense) + experts
    assert actor.weights == 2 * actor.params_gpu and actor.grads == 4 * actor.params_gpu
    assert actor.optimizer == pytest.approx(12 * dense / 32 + 12 * experts / 8)
    # expert-TP 2 splits every expert in two and halves the expert-DP group (64 / (2 * 8) = 4)
    (etp2,) = plan.model_states(a, load_config(None, ["model.name=qwen3-30b-a3b", "parallel.tp=2", "parallel.ep=8",
                                                      "parallel.nodes=8"]), world=64)
    assert etp2.params_gpu == int(dense) + experts // 2
    assert etp2.optimizer == pytest.approx(12 * dense / 32 + 12 * (experts // 2) / 4)


def test_moe_activations_and_dispatcher_buffers():
    # Qwen3-30B-A3B, TP=2 with SP, expert-TP 1, selective recompute, 32768 tokens per micro-batch,
    # routing imbalance u = 2: the GPU routes t = 16384 tokens
    cfg = load_config(None, ["model.name=qwen3-30b-a3b", "parallel.tp=2", "parallel.ep=8", "parallel.etp=1",
                             "parallel.nodes=8", "model.sequence_parallel=true", "model.recompute=selective",
                             "model.transformer_impl=transformer_engine", "actor.max_tokens_per_microbatch=32768",
                             "data.max_prompt_len=2048", "rollout.max_new_tokens=20480"])
    h, k, fe, E, u = 2048, 8, 768, 128, 2.0
    # R = 8h, S = 4ad + 4gd (no shared expert, no core-attention term), M = 8E + (2kh + 6k fe) u + 2kh
    per_token = (8 * h + 4 * 32 * 128 + 4 * 4 * 128 + 8 * E + (2 * k * h + 6 * k * fe) * u + 2 * k * h) / 2
    assert plan.activation_bytes_per_token_layer(QWEN3_30B, cfg, 22528, moe_imbalance=u) == per_token
    acts = plan.activation_bytes(QWEN3_30B, cfg, "actor", moe_imbalance=u)
    assert acts["layers"] == 48 * 32768 * per_token
    t = 16384
    assert acts["moe_buffers"] == 2 * k * t * h + 2 * k * t * h * u + 6 * k * t * fe * u
    assert acts["total"] == acts["layers"] + acts["logits"] + acts["moe_buffers"]
    # expert-TP 2: each routed copy is all-gathered over the 2 expert-TP ranks (and the buffer for it)
    cfg2 = load_config(None, ["model.name=qwen3-30b-a3b", "parallel.tp=2", "parallel.ep=8", "parallel.nodes=8",
                              "model.sequence_parallel=true", "model.recompute=selective",
                              "model.transformer_impl=transformer_engine", "actor.max_tokens_per_microbatch=32768",
                              "data.max_prompt_len=2048", "rollout.max_new_tokens=20480"])
    acts2 = plan.activation_bytes(QWEN3_30B, cfg2, "actor", moe_imbalance=1.0)
    assert acts2["moe_buffers"] == 2 * k * t * h + 2 * k * t * h + 2 * k * t * 2 * h + 6 * k * t * fe
    # a dense model has no MoE terms
    assert plan.activation_bytes(QWEN32, long_cfg("actor.max_tokens_per_microbatch=65536"), "actor")["moe_buffers"] == 0


def test_moe_train_flops_count_active_parameters():
    cfg = load_config(os.path.join(CONFIGS, "recipes", "qwen3-30b-a3b", "dapo.yaml"))
    t = plan.step_time(cfg, QWEN3_30B, plan.GPUS["h100"], 64, kv_tokens=1e6, avg_prompt_len=200,
                       avg_response_len=1800, mfu=0.5, decode_eff=0.6, gen_rounds=1)
    per_token_fwd = 2 * 3_353_032_704 + 4 * 48 * 32 * 128 * 1000  # 2 N_active + causal attention, mean context 1000
    assert t["train_flops"] == pytest.approx(per_token_fwd * 512 * 16 * 2000 * (1 + 4))


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_moe_layout_without_enough_expert_parallelism_is_rejected(gpu):
    # Qwen3-235B-A22B on 16 nodes with EP 2 instead of 64: 32x the routed experts per GPU (56.8B,
    # 212 GiB of bf16 weights and gradients)
    recipe = os.path.join(CONFIGS, "recipes", "qwen3-235b-a22b", "dapo.yaml")
    layout = os.path.join(CONFIGS, "layouts", "qwen3-235b-a22b", "16node.yaml")
    cfg = load_config([recipe, layout], ["parallel.ep=2"])
    pl = plan.plan(cfg, QWEN3_235B, hf_json("qwen3-235b-a22b"), plan.GPUS[gpu])
    assert not pl.fits and any("the largest term is model states" in p for p in pl.problems)
    # and one whose experts do not divide by EP is reported, not crashed on
    pl = plan.plan(load_config([recipe, layout], ["parallel.ep=3", "parallel.pp=1"]), QWEN3_235B,
                   hf_json("qwen3-235b-a22b"), plan.GPUS[gpu])
    assert any("num_experts=128 is not divisible by ep=3" in p for p in pl.problems)


def test_moe_cli(capsys):
    rc, out = plan_cli(capsys, "qwen3-30b-a3b", "vapo", "8node")
    assert rc == 0 and "FITS" in out and "3.35B active: 128 experts, top-8" in out
    cfg = load_config([os.path.join(CONFIGS, "recipes", "qwen3-30b-a3b", "vapo.yaml"),
                       os.path.join(CONFIGS, "layouts", "qwen3-30b-a3b", "8node.yaml")])
    p = cfg.parallel
    experts = QWEN3_30B.stage_expert_params(p.pp, p.ep, 1) / 1e9  # the last stage's routed experts per GPU
    assert f"ep={p.ep} etp=1 edp={64 // (p.ep * p.pp)}" in out and f"({experts:.2f}B routed experts)" in out
    assert "MoE dispatcher" in out
    r = cfg.rollout
    assert f"rollout_tp={p.rollout_tp} (attention dp {r.sglang_dp_size}, engine ep {r.sglang_ep_size})" in out


def test_unmodelled_moe_is_refused():
    with pytest.raises(plan.ConfigError, match="not modelled"):
        plan.Arch.from_hf({"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 4096,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 14336,
                           "vocab_size": 32000})


@pytest.mark.parametrize("cp,row,seq_len", [(1, 16384, 2048), (1, 65536, 65536), (2, 16384, 1024), (4, 262144, 65536)])
def test_planner_attention_block_is_the_attentions_own(cp, row, seq_len):
    """plan_activations mirrors megarl.models.attention_blockwise.query_block_size (GPU sizing) without
    importing torch; the two must pick the same block."""
    attention = pytest.importorskip("megarl.models.attention_blockwise")
    cfg = long_cfg("model.transformer_impl=local", "model.dtype=fp32", "model.sequence_parallel=false", f"parallel.cp={cp}",
                   "actor.max_tokens_per_microbatch=65536")
    heads = QWEN32.heads // cfg.parallel.tp
    workspace = sys.modules[plan.activation_bytes.__module__].attention_workspace_bytes(QWEN32, cfg, row, seq_len)
    assert workspace == 16 * heads * seq_len * attention.query_block_size(heads, row // cp, row, seq_len)


def test_sync_phase_holds_the_actor_weights_the_engine_weights_and_the_stream_buffers():
    """The weight sync (megarl.trainer.components.sync_weights): with rollout.offload_train_state the
    gradients, optimizer state and other models are off the GPU, the actor's weights (the stream's
    source) stay, the engine's weights come back, and the stream allocates its buckets' buffers
    (megarl.planner.stream_transient_bytes; SGLang flattens each bucket once more)."""
    cfg = load_config(["configs/recipes/qwen3-235b-a22b/dapo.yaml", "configs/layouts/qwen3-235b-a22b/16node.yaml"])
    arch, hf, _ = plan.load_arch(cfg)
    pl = plan.plan(cfg, arch, hf, plan.GPUS["h100"])
    bucket = cfg.rollout.weight_bucket_mb * 2**20
    actor = pl.states[0]
    assert cfg.rollout.offload_train_state and cfg.rollout.engine == "sglang"
    stream = plan.stream_transient_bytes(bucket, cfg.parallel.tp, cfg.parallel.pp) + bucket
    assert pl.sync_stream == stream
    assert pl.sync_peak == pytest.approx(actor.weights + pl.engine_weights + stream + pl.reserve)
    assert plan.stream_transient_bytes(100, 4, 2) == 100 * (2 + 1 / 4 + 1) and plan.stream_transient_bytes(100, 1, 1) == 100
    cfg.rollout.offload_train_state = False  # every model state stays on the GPU meanwhile
    kept = plan.plan(cfg, arch, hf, plan.GPUS["h100"])
    assert kept.sync_peak == pytest.approx(sum(s.resident for s in kept.states) + pl.engine_weights + stream + pl.reserve)


def test_an_offloaded_optimizer_is_not_on_the_gpu_at_its_step():
    """megatron's HybridDeviceOptimizer (offload fraction 1) steps on the host: the GPU holds weights
    and gradients only."""
    cfg = load_config(["configs/recipes/qwen3-30b-a3b/vapo.yaml", "configs/layouts/qwen3-30b-a3b/1node.yaml"])
    arch, _, _ = plan.load_arch(cfg)
    for s in plan.model_states(arch, cfg, 8):
        assert s.offload_optimizer and s.at_step == s.weights + s.grads == s.resident
