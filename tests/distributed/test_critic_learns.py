"""The critic learns, and its values are aligned with the tokens they score: a critic built as the
trainer builds it, trained through the trainer's own functions on a synthetic task whose return
is a known function of the prefix (tests/distributed/scripts_critic.py), 2 gloo ranks, TP=2."""

import pytest

from tests.distributed.launch import run_worker, tiny_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    tiny_model(root / "model")
    overrides = [
        f"model.hf_path={root / 'model'}", "model.dtype=fp32", "model.transformer_impl=local", "parallel.tp=2",
        "data.max_prompt_len=16", "rollout.max_new_tokens=16", "critic.lr=1e-3", "critic.lr_warmup_steps=0",
        "critic.weight_decay=0.0", "critic.max_tokens_per_microbatch=4096", "actor.max_tokens_per_microbatch=4096",
    ]
    return run_worker("scripts_critic.py", 2, root, "--steps", 30, config="algorithms/vapo.yaml", overrides=overrides)


def test_monte_carlo_targets_are_the_score_at_every_token(result):
    # gamma = lambda = 1, reward on the last token: the return of token 0 is the sample's score
    assert result["returns_token0"] == pytest.approx(result["scores"])
    assert sorted(set(result["scores"])) == [-1.0, 1.0]


def test_critic_fits_a_return_that_the_prefix_determines(result):
    # an untrained critic explains nothing; after 30 steps it explains most of the held-out variance
    assert abs(result["ev_first"]) < 0.2
    assert result["ev_held_out"] > 0.5, result["ev_history"]
    assert result["mse_later"] < 0.15


def test_value_does_not_see_the_token_it_scores(result):
    # token 0 decides the return, but its value (state before token 0) cannot know it: its error
    # stays near the return variance (1), where a critic reading one position late would reach ~0
    assert result["mse_token0"] > 0.6


def test_critic_backbone_from_a_policy_checkpoint(result):
    # critic.init_from = a policy checkpoint: its backbone is that checkpoint's, with a value head
    assert result["init_from_tensors"] > 10 and result["init_from_has_value_head"]
    assert result["init_from_max_diff_to_checkpoint"] == 0.0
    assert result["init_from_min_diff_to_actor"] > 1e-3  # not the actor's current (moved) weights
