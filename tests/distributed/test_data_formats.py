"""verl parquet, slime JSONL, a datasets.save_to_disk folder and an HF-cache dataset by name each
train 2 RL steps with the same prompts and rewards as the native rows they were made from
(2 gloo ranks, strict device mode; worker: scripts_data_formats.py)."""

import pytest

from tests.distributed.launch import REPO, run_torchrun

VOLATILE = ("time/", "perf/", "reward/time")
FORMATS = ["verl", "slime", "save_to_disk", "hf_cache"]
SCORE = "tests.distributed.scripts_data_formats:score"  # a reward that varies on the untrained model
TINY = ["data.prompt_template=arith", "model.dtype=fp32", "model.transformer_impl=local",
        f"reward.sources={{arith: '{SCORE}'}}", "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    cache = root / "hf_cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_CACHE", str(cache))  # the worker's datasets reads these at import
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    try:
        return run_torchrun(REPO / "tests/distributed/scripts_data_formats.py", 2, [
            "--root", str(root), "--cache", str(cache), *TINY, "data.eval=[]", "data.max_prompt_len=32",
            "rollout.max_new_tokens=8", "algorithm.mini_batch_size=8", "actor.max_tokens_per_microbatch=64",
            "trainer.total_steps=2", "trainer.save_interval=0", "trainer.loggers=[jsonl]", "actor.lr=1e-3",
            "actor.lr_warmup_steps=0"], root / "out.json", timeout=600)
    finally:
        mp.undo()


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_trains_like_the_native_rows(result, fmt):
    native, got = result["native"], result[fmt]
    assert got["prompt_ids"] == native["prompt_ids"] and got["answers"] == native["answers"]
    rows = comparable(got["rows"])
    assert [r["step"] for r in rows] == [1, 2]
    assert rows == comparable(native["rows"])  # rewards, losses, lengths: the same rollouts and updates
    assert 0 < rows[0]["reward/mean"] < 1 and all(r["actor/grad_norm"] > 0 for r in rows)  # rewards that differ
