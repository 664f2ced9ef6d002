"""trainer.async_save on CPU for real: megatron dist_checkpointing's async save (forked writer
processes, gloo) through megarl.trainer.checkpoint, 2 ranks with the distributed optimizer
(tests/distributed/scripts_async_checkpoint.py). `latest` moves only once the writes are
finalised, the checkpoint holds the state of save time, and killed writers never leave
`latest` on an incomplete checkpoint."""

import pytest

from tests.distributed.launch import run_worker, tiny_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_ckpt")
    tiny_model(root / "model", hidden=256, intermediate=512)
    overrides = [f"model.hf_path={root / 'model'}", "model.dtype=fp32", "model.transformer_impl=local",
                 "actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.max_tokens_per_microbatch=64",
                 "rollout.max_new_tokens=16", "data.max_prompt_len=32"]
    return run_worker("scripts_async_checkpoint.py", 2, root, overrides=overrides)


def test_latest_moves_only_after_the_async_writes_are_finalised(result):
    assert result["latest_after_sync"] == "step_1"
    assert result["latest_before_finalize"] == "step_1" and result["metadata_before_finalize"] is False
    assert result["latest_after_finalize"] == "step_2" and result["step2_problems"] == []


def test_async_checkpoint_holds_the_state_of_save_time(result):
    assert result["changed_after_save"] is True  # the step after the save changed params + Adam state
    assert result["loaded_equals_save_time"] is True


def test_killed_async_writers_never_leave_latest_on_an_incomplete_checkpoint(result):
    outcomes = set(result["kill_outcomes"])
    assert len(outcomes) == 1, outcomes  # every rank finalised alike
    assert result["latest_problems_after_kill"] == []
    if result["kill_outcome"].startswith("finalize raised"):
        assert result["latest_after_kill"] == "step_2" and result["step3_problems"]
    else:
        assert result["latest_after_kill"] == "step_3" and result["step3_problems"] == []
    print("kill outcome:", result["kill_outcome"])
