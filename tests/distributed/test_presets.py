"""Every preset in configs/algorithms/ and configs/recipes/ (cluster sizes scaled down to the tiny
model on 2 gloo ranks) runs RL steps and shows its mechanism in the metrics; custom reward and
advantage functions named by dotted path are used by a run."""

import pytest

from tests.distributed.launch import REPO, rl_files, run_worker, tiny_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rl_files(tmp_path_factory.mktemp("presets"), n_sft=4, n_eval=4)
    tiny_model(root / "moe_model", family="qwen3_moe", num_experts=4, moe_topk=2, moe_intermediate=64)
    for family, name in (("deepseek_v3", "deepseek_model"), ("glm4_moe", "glm_model"), ("qwen3_next", "hybrid_model")):
        tiny_model(root / name, family=family, num_experts=4, moe_topk=2, moe_intermediate=64)
    return run_worker("scripts_presets.py", 2, root, timeout=1200)


def presets(result, algorithm):
    runs = {k: v["rows"] for k, v in result.items() if isinstance(v, dict) and v.get("algorithm") == algorithm}
    assert runs, algorithm
    return runs


def train_rows(rows):
    return [r for r in rows if "time/step" in r]  # eval rows carry eval/* only


def test_every_preset_ran():
    names = {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").glob("algorithms/*.yaml")}
    names |= {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").glob("recipes/*/*.yaml")}
    assert len(names) == 34


def test_pag_preset_rolls_out_multi_turn_trajectories(result):
    rows = train_rows(result["algorithms/pag.yaml"]["rows"])
    assert rows and all(0 <= r["pag/verify_accuracy"] <= 1 and "pag/final_accuracy" in r for r in rows)


def test_retool_preset_rolls_out_tool_trajectories(result):
    rows = train_rows(result["algorithms/retool.yaml"]["rows"])  # an untrained model calls no tool: the counts are there
    assert rows and all(0 <= r["tools/call_rate"] <= 1 and "tools/turn_budget_frac" in r for r in rows)


def test_moe_recipes_ran_at_ep2_on_the_tiny_moe(result):
    # Qwen3-30B-A3B / 235B-A22B / VL-30B-A3B / VL-235B-A22B recipes: the tiny Qwen3-MoE, experts over 2
    # ranks; MoE steps log routing agreement, and the recipes' routing replay makes every router use the
    # engine's experts
    moe = {k: v["rows"] for k, v in result.items() if k.startswith("recipes/qwen3-")}
    assert len(moe) == 6
    for name, rows in moe.items():
        rows = train_rows(rows)
        assert rows and all(0 <= r["moe/routing_agreement"] <= 1 for r in rows), name
        assert all(r["moe/replayed_fraction"] == 1.0 for r in rows), name


def test_sigmoid_moe_recipes_ran_on_their_tiny_family(result):
    # DeepSeek-V3 / Kimi-K2 recipes on a tiny DeepSeek-V3 (multi-latent attention), GLM-4.5 ones on a tiny
    # GLM-4.5: sigmoid routing with the selection bias, the dense first layer, routing replay at EP=2
    families = ("deepseek-v3", "kimi-k2", "glm-4.5", "glm-4.5-fp8", "glm-4.5-air")
    runs = {k: v["rows"] for k, v in result.items() if k.split("/")[1:2] in [[f] for f in families]}
    assert len(runs) == 5
    for name, rows in runs.items():
        rows = train_rows(rows)
        assert rows and all(r["moe/replayed_fraction"] == 1.0 for r in rows), name


def test_all_presets_ran_every_step(result):
    for name, v in result.items():
        if name == "calls":
            continue
        rows = train_rows(v["rows"])
        assert rows and all(r["step"] == i + 1 for i, r in enumerate(rows)), name
        assert "eval/accuracy" in v["rows"][-1] or "eval/accuracy" in v["rows"][-2], name


def test_dapo_presets_filter_groups_and_clip_higher(result):
    for name, rows in presets(result, "dapo").items():
        for r in train_rows(rows):
            assert r["rollout/rounds"] >= 1 and 0 < r["rollout/kept_group_frac"] <= 1, name
            assert "actor/clipfrac_high" in r and "actor/kl_loss" not in r and "critic/value_loss" not in r, name


def test_grpo_presets_pay_a_kl_loss_to_the_reference(result):
    for name, rows in presets(result, "grpo").items():
        rows = train_rows(rows)
        # k3 KL >= 0; 0 only while the actor equals the reference (first mini-batch of step 1)
        assert all(r["actor/kl_loss"] >= 0 for r in rows) and rows[-1]["actor/kl_loss"] > 0, name
        assert "critic/value_loss" not in rows[-1], name


def test_ppo_presets_train_a_critic(result):
    for name, rows in presets(result, "ppo").items():
        for r in train_rows(rows):
            assert "critic/value_loss" in r and "critic/explained_variance" in r and "actor/pg_loss" in r, name


@pytest.mark.parametrize("algorithm", ["vc_ppo", "vapo"])
def test_value_pretraining_then_policy_updates(result, algorithm):
    for name, rows in presets(result, algorithm).items():
        rows = train_rows(rows)
        assert "critic/value_loss" in rows[0] and "actor/pg_loss" not in rows[0], name  # value pretraining step
        assert "actor/pg_loss" in rows[-1], name
        if algorithm == "vapo":
            assert rows[-1]["actor/pos_lm_loss"] > 0, name  # positive-example LM loss


def test_tppo_preset_carries_windows(result):
    for name, rows in presets(result, "tppo").items():
        rows = train_rows(rows)  # window 4, max_new_tokens 12: responses span 3 windows (3 steps)
        assert "actor/pg_loss" not in rows[0] and "actor/pg_loss" in rows[-1], name  # value pretraining first
        assert [r["rollout/unfinished_samples"] for r in rows[:2]] == [16, 16], name
        assert rows[1]["rollout/continued_samples"] == 16 and rows[-1]["rollout/finished_samples"] == 16, name
        assert all(0 < r["rollout/window_tokens_mean"] <= 4 for r in rows), name
        assert "critic/value_loss" in rows[-1] and "rollout_is/ratio_mean" in rows[-1], name


def test_custom_reward_and_advantage_by_dotted_path(result):
    assert result["calls"]["reward"] > 0 and result["calls"]["advantage"] > 0
    rows = train_rows(result["custom_advantage"]["rows"])
    assert rows and 0 < rows[0]["reward/accuracy"] < 1  # the coin reward, not the arithmetic checker


OBJECTIVE_METRIC = {"gspo": "actor/seq_ratio_mean", "gspo_token+remax": "reward/greedy_baseline_mean",
                    "cispo+opo": "actor/clipfrac_high", "sapo": "actor/gate_mean", "clip_cov": "actor/cov_detached_frac",
                    "kl_cov": "actor/kl_cov_frac", "gmpo": "actor/clipfrac", "gpg+gpg": "actor/pg_loss"}


def test_every_objective_runs_rl_steps(result):
    import math

    runs = presets(result, "objective")
    assert set(runs) == {f"objective/{k}" for k in OBJECTIVE_METRIC}
    for name, rows in runs.items():
        rows = train_rows(rows)
        assert [r["step"] for r in rows] == [1, 2], name
        for r in rows:
            assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]), (name, r)
            assert OBJECTIVE_METRIC[name.split("/", 1)[1]] in r, name
            assert "actor/kl_loss" not in r, name


def test_hybrid_recipes_ran_on_the_tiny_qwen3_next(result):
    # Qwen3.5-35B-A3B / 397B-A17B recipes on a tiny Qwen3-Next (gated delta-net layers and one gated
    # attention layer, MoE with a shared expert): experts over 2 ranks, every token's experts replayed
    runs = {k: v["rows"] for k, v in result.items() if k.startswith("recipes/qwen3.5-")}
    assert len(runs) == 3
    for name, rows in runs.items():
        rows = train_rows(rows)
        assert rows and all(r["moe/replayed_fraction"] == 1.0 for r in rows), name

