"""The RL trainer on megatron-core with 2 gloo ranks (strict device mode): layout equivalence,
resume, NaN safety."""

import math

import pytest

from tests.distributed.launch import rl_files, rl_overrides, run_worker

VOLATILE = ("time/", "perf/", "reward/time")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rl_files(tmp_path_factory.mktemp("trainer"))
    overrides = rl_overrides(root) + [
        "data.max_prompt_len=32", "parallel.tp=2", "rollout.max_new_tokens=12",
        "algorithm.mini_batch_size=4", "actor.lr=1e-3", "critic.lr=1e-3", "actor.max_tokens_per_microbatch=64",
        "critic.max_tokens_per_microbatch=64", "trainer.save_interval=1", "trainer.eval_interval=0",
        "trainer.keep_last=2", "eval.n_samples=1", "eval.temperature=0", "eval.max_new_tokens=12",
        "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0",
    ]
    return run_worker("scripts_trainer.py", 2, root, config="algorithms/ppo.yaml", overrides=overrides, timeout=900)


def test_tp2_and_pp2_train_like_tp1(result):
    lay = result["layouts"]
    ref = lay["tp1_pp1"]
    assert ref["losses"][0] != 0.0 and all(math.isfinite(x) for x in ref["losses"] + ref["grad_norms"])
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], abs=1e-7)  # the first step changed the policy
    for name in ("tp2_pp1", "tp1_pp2"):
        assert lay[name]["losses"] == pytest.approx(ref["losses"], abs=2e-5), name
        assert lay[name]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4), name
    assert lay["tp1_pp2"]["schedule"] == "forward_backward_pipelining_without_interleaving"
    assert lay["tp2_pp1"]["schedule"] == "forward_backward_no_pipelining"


def test_resume_matches_uninterrupted_run(result):
    straight = {r["step"]: r for r in result["resume"]["straight"] if "actor/pg_loss" in r}
    resumed = {r["step"]: r for r in result["resume"]["resumed"] if "actor/pg_loss" in r}
    assert sorted(straight) == sorted(resumed) == [1, 2, 3]
    for key, value in straight[3].items():
        if key.startswith(VOLATILE) or value is None:
            continue
        assert resumed[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_nan_loss_stops_step_and_keeps_checkpoint(result):
    nan = result["nan"]
    assert "non-finite" in nan["error"]
    assert nan["latest_before"] == nan["latest_after"]
