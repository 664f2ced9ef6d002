"""Issue 15 (training, qwen2_5_vl): the trainer's packed micro-batches carry each sequence's images
and M-RoPE ids; after an update and a weight stream at TP=2 (sequence parallel, 2 gloo ranks, strict
device mode) the builtin engine's log-probs with images equal the trainer's; model.freeze_vision
keeps the tower as loaded; a vision-language critic trains (tests/distributed/scripts_vlm_train.py)."""

from tests.distributed.launch import CPU_ONLY, worker_fixture

pytestmark = CPU_ONLY
TOL = 1e-5
results = worker_fixture("scripts_vlm_train.py", 2)


def test_trainer_logprobs_with_images_equal_engine_after_update_and_stream(results):
    assert results["pre_update_diff"] < TOL  # same weights (the HF files) before the update
    assert results["update"]["actor/grad_norm"] > 0
    assert results["visual_changed"] == results["n_visual"] == 30  # the tower trained and was streamed
    assert results["rows_with_images"] == 6 and results["n_tokens"] >= 40
    assert results["microbatches"] > 1  # several packed micro-batches, images split between them
    assert results["logprob_max_abs_diff"] < TOL, results["logprob_max_abs_diff"]


def test_comparison_has_teeth(results):
    assert results["teeth_zero_pixels"] > 1e-3  # the pixels reach the log-probs
    assert results["teeth_1d_positions"] > 1e-3  # and the M-RoPE ids matter


def test_freeze_vision(results):
    assert results["frozen_trainable_visual"] == 0
    assert results["frozen_visual_changed"] == 0
    assert results["frozen_lm_changed"] > 20


def test_vision_language_critic(results):
    assert results["values_finite"]
    assert results["values_zero_pixels_diff"] > 1e-4  # the critic sees the images
    assert results["critic_update"]["critic/grad_norm"] > 0
    assert results["critic_values_moved"] > 1e-4


def test_rl_step_trains_past_rows_with_bad_images(results):
    r = results["rl_loop"]
    step = next(row for row in r["rows"] if row["step"] == 1 and "actor/entropy" in row)
    # 4 prompts x 2 samples generated with images and passed through the actor update (a random
    # tiny model: all-wrong groups, so GRPO's advantages and gradient may be 0)
    assert step["reward/count"] == 8 and step["actor/entropy"] > 0 and step["response_length/mean"] > 0
    (warning,) = r["warnings"]
    assert "skipped 3 row(s) with unusable images" in warning
    for name, why in (("bad-missing", "missing.png"), ("bad-broken", "not a readable image"),
                      ("bad-huge", "64 tokens > data.max_image_tokens 40")):
        assert f"id '{name}'" in warning and why in warning, (name, warning)
