"""Optimizer checkpoints (megarl.weights.optim_ckpt) saved at DP=2 and resumed at DP=4, gloo,
strict device mode: the loaded shards equal the saved ones bit for bit, the resumed updates equal
the uninterrupted ones (dense actor, MoE from EP=2 with frozen routers to EP=1 and from EP=1 to
EP=2, critic), the
checkpoints of megatron's gathering writer still load, another megatron format fails naming its
file, every rank's writer touches only its own shard while the gathering one holds the whole
DP group's state on every rank, and an offload_optimizer checkpoint (HybridDeviceOptimizer) loads
with weights_only and steps on."""

import pytest

from tests.distributed.launch import CPU_ONLY, rl_files, rl_overrides, run_worker

pytestmark = CPU_ONLY
STATES = 3  # fp32 main weights, exp_avg, exp_avg_sq


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rl_files(tmp_path_factory.mktemp("optim_ckpt"))
    overrides = rl_overrides(root) + [
        "data.max_prompt_len=32", "rollout.max_new_tokens=12", "algorithm.mini_batch_size=4",
        "actor.lr=1e-2", "critic.lr=1e-2", "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0",
        "actor.max_tokens_per_microbatch=64", "critic.max_tokens_per_microbatch=64"]
    saved = run_worker("scripts_optim_checkpoint.py", 2, root, "--phase", "save", config="algorithms/ppo.yaml",
                       overrides=overrides)
    loaded = run_worker("scripts_optim_checkpoint.py", 4, root, "--phase", "load", config="algorithms/ppo.yaml",
                        overrides=overrides)
    return saved, loaded


def same_run(a: dict, b: dict, rel: float) -> bool:
    return all(x == pytest.approx(y, rel=rel) for key in ("losses", "grad_norms") for x, y in zip(a[key], b[key]))


@pytest.mark.parametrize("case", ["dense", "moe_frozen_router", "moe_ep1_to_ep2", "critic"])
def test_resume_at_dp4_equals_the_uninterrupted_dp2_run(result, case):
    saved, loaded = result
    assert same_run(loaded[case]["sharded"], saved[case]["straight"], rel=1e-5), (loaded[case], saved[case])
    if not case.startswith("moe"):  # parameter names differ between EP layouts
        assert loaded[case]["sharded_mismatches"] == 0


def test_moe_resumes_into_another_optimizer_chain(result):
    saved, loaded = result
    moe = loaded["moe_frozen_router"]
    # EP=2: megatron's dense and expert-parallel optimizers; EP=1: one optimizer for everything
    assert (saved["moe_frozen_router"]["chain"], moe["chain"]) == (2, 1)
    assert (saved["moe_ep1_to_ep2"]["chain"], loaded["moe_ep1_to_ep2"]["chain"]) == (1, 2)
    # megatron's gathered checkpoint of the chain (keys prefixed chained_<i>.) loads as well
    assert same_run(moe["gathered"], saved["moe_frozen_router"]["straight"], rel=1e-5)


def test_the_optimizer_state_matters_and_gathered_checkpoints_still_load(result):
    saved, loaded = result
    dense = loaded["dense"]
    assert dense["gathered_mismatches"] == 0
    assert same_run(dense["gathered"], saved["dense"]["straight"], rel=1e-5)
    # control: the same resume without the optimizer state ends elsewhere
    resumed, control = dense["sharded"]["losses"][1], dense["no_optimizer"]["losses"][1]
    assert abs(control - resumed) > 1e-3 * abs(resumed)


def test_another_megatron_format_fails_naming_its_file(result):
    err = result[1]["dp_reshardable_error"]
    assert "dense/dp_reshardable/optimizer/common.pt" in err and "dp_reshardable" in err.split(":", 1)[1]


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_writes_only_its_own_shard(result, dp):
    ranks = result[0]["bytes_dp2"] if dp == 2 else result[1]["bytes_dp4"]
    params = ranks[0]["params"]
    assert sum(r["owned"] for r in ranks) == params  # the DP ranks' shards tile the model
    for r in ranks:
        # megarl's writer: views of this rank's optimizer state, nothing allocated
        assert r["sharded"] == {"elements": STATES * r["owned"], "extra_bytes": 0}
        # megatron's gathering writer: the whole DP group's state on every rank, whatever DP
        assert r["gathered"]["extra_bytes"] == STATES * 4 * params
        assert r["gathered"]["elements"] == STATES * params


def test_offload_optimizer_checkpoint_loads_and_steps(result):
    hybrid = result[0]["hybrid"]
    assert hybrid["optimizer"] == "HybridDeviceOptimizer" and hybrid["moved"]
    assert hybrid["loaded_equals_save_time"] and hybrid["step_after_load"] > 0
