"""Shipped algorithm presets and recipes carry the papers' settings (docs/algorithms.md) and load cleanly."""

from __future__ import annotations

import glob
import json
import os

import pytest

from megarl.config import load_config, validate_model, validate_world

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")
RECIPES = sorted(glob.glob(os.path.join(CONFIGS, "recipes", "*", "*.yaml")))
ALGORITHMS = sorted(glob.glob(os.path.join(CONFIGS, "algorithms", "*.yaml")))


def algo(name: str):
    return load_config(os.path.join(CONFIGS, "algorithms", f"{name}.yaml"))


def test_expected_files_are_shipped():
    names = {os.path.relpath(p, os.path.join(CONFIGS, "recipes")) for p in RECIPES}
    assert names == {f"qwen2.5-32b/{a}.yaml" for a in ("dapo", "vapo", "ppo", "grpo")} | {
        f"qwen2.5-7b/{a}.yaml" for a in ("dapo", "vapo", "grpo")} | {
        f"{m}/{a}.yaml" for m in ("qwen3-30b-a3b", "qwen3-235b-a22b") for a in ("dapo", "vapo")} | {
        "qwen2.5-vl-7b/dapo.yaml", "qwen2.5-vl-7b/grpo.yaml", "qwen2.5-vl-32b/dapo.yaml", "qwen3-vl-30b-a3b/dapo.yaml",
        "qwen3-vl-235b-a22b/dapo.yaml"} | {
        f"{m}/dapo.yaml" for m in ("deepseek-v3", "kimi-k2", "glm-4.5", "glm-4.5-fp8", "glm-4.5-air")} | {
        f"{m}/dapo.yaml" for m in ("qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3.5-397b-a17b-fp8")}
    assert {os.path.basename(p) for p in ALGORITHMS} == {f"{a}.yaml" for a in ("grpo", "dapo", "ppo", "vc_ppo", "vapo", "tppo", "pag", "pairwise_rl", "code_prm", "retool")}


@pytest.mark.parametrize("path", ALGORITHMS + RECIPES, ids=lambda p: os.path.relpath(p, CONFIGS))
def test_every_preset_and_recipe_loads(path):
    cfg = load_config(path)
    assert cfg.algorithm.name == os.path.splitext(os.path.basename(path))[0]


def test_dapo_paper_settings():
    c = algo("dapo")
    a, r = c.algorithm, c.rollout
    assert (a.advantage, a.loss_agg, a.clip_low, a.clip_high, a.kl_coef, a.entropy_coef) == ("grpo", "token-mean", 0.2, 0.28, 0.0, 0.0)
    assert a.dynamic_sampling and a.overlong_penalty and not a.overlong_filter
    assert (a.overlong_max_len, a.overlong_cache_len, a.overlong_factor) == (20480, 4096, 1.0)
    assert (r.prompts_per_step, r.n_samples_per_prompt, r.max_new_tokens, r.gen_batch_prompts, r.max_gen_batches) == (512, 16, 20480, 1536, 10)
    assert r.prompts_per_step * r.n_samples_per_prompt // a.mini_batch_size == 16  # 16 updates per step
    assert (c.actor.lr, c.actor.lr_warmup_steps, c.actor.lr_decay_style) == (1e-6, 20, "constant")
    assert (c.actor.weight_decay, c.actor.clip_grad) == (0.1, 1.0)
    assert (c.eval.n_samples, c.eval.temperature, c.eval.top_p) == (32, 1.0, 0.7)
    assert (c.reward["correct_score"], c.reward["incorrect_score"]) == (1.0, -1.0)
    assert not c.critic.enable


def test_vapo_paper_settings():
    c = algo("vapo")
    a = c.algorithm
    assert (a.advantage, a.lam_critic, a.length_adaptive_alpha, a.pos_lm_coef, a.value_pretrain_steps) == ("gae", 1.0, 0.05, 0.1, 50)
    assert (a.clip_low, a.clip_high, a.loss_agg, a.gamma, a.kl_coef) == (0.2, 0.28, "token-mean", 1.0, 0.0)
    assert (c.actor.lr, c.critic.lr, c.critic.enable) == (1e-6, 2e-6, True)
    assert (c.rollout.prompts_per_step, c.rollout.n_samples_per_prompt, a.mini_batch_size) == (512, 16, 512)


def test_ppo_vc_ppo_grpo_settings():
    p = algo("ppo")
    assert (p.algorithm.advantage, p.algorithm.lam_actor, p.algorithm.lam_critic, p.algorithm.loss_agg) == ("gae", 0.95, 0.95, "seq-mean-token-mean")
    assert (p.rollout.prompts_per_step, p.rollout.n_samples_per_prompt, p.algorithm.mini_batch_size) == (8192, 1, 512)
    v = algo("vc_ppo")
    assert (v.algorithm.lam_actor, v.algorithm.lam_critic, v.algorithm.value_pretrain_steps) == (0.95, 1.0, 50)
    g = algo("grpo")
    assert (g.algorithm.advantage, g.algorithm.loss_agg, g.algorithm.kl_type) == ("grpo", "seq-mean-token-mean", "k3")
    assert g.algorithm.kl_coef > 0 and not g.critic.enable


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, CONFIGS))
def test_recipe_layout_matches_model_and_world(path):
    cfg = load_config(path)
    with open(os.path.join(CONFIGS, "models", f"{cfg.model.name}.json")) as f:
        hf = json.load(f)
    validate_model(cfg, hf)
    validate_world(cfg, cfg.parallel.nodes * cfg.parallel.gpus_per_node)
    assert cfg.rollout.engine == "sglang" and cfg.model.dtype == "bf16"
    # an MoE recipe replays the engine's routing (SGLang returns the routed experts)
    text = hf.get("text_config") or hf
    assert cfg.algorithm.routing_replay == bool(text.get("num_experts") or text.get("n_routed_experts"))
    if "qwen2.5-32b" in path:
        assert cfg.rollout.max_new_tokens >= 20480  # the papers' response length


def test_every_layout_composes_with_its_models_recipes():
    for layout in glob.glob(os.path.join(CONFIGS, "layouts", "*", "*node.yaml")):
        model = os.path.basename(os.path.dirname(layout))
        nodes = int(os.path.basename(layout).removesuffix("node.yaml"))
        for recipe in glob.glob(os.path.join(CONFIGS, "recipes", model, "*.yaml")):
            cfg = load_config([recipe, layout])
            assert cfg.parallel.nodes == nodes and cfg.parallel.gpus_per_node == 8
            validate_world(cfg, nodes * 8)
