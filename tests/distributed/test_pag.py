"""PAG multi-turn trajectories on megatron-core with 2 gloo ranks (TP=2, strict device mode;
tests/distributed/scripts_pag.py): the instruction tokens sit where the turn layout says, carry no
loss and no value, and on every generated token of every turn the trainer's log-prob equals the
builtin engine's; the RL loop trains on such trajectories with per-turn PAG metrics."""

import math

import pytest

from tests.distributed.launch import logprob_gaps, rl_files, rl_overrides, run_worker

# |engine - trainer| log-prob per generated token (fp32, CPU): the T-PPO gate (tests/distributed/test_tppo.py)
MISMATCH_MEAN, MISMATCH_MAX = 2e-6, 2e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rl_files(tmp_path_factory.mktemp("pag"))
    overrides = rl_overrides(root, eval_set=False) + [
        f"sft.data_path={root / 'sft.jsonl'}", "sft.batch_size=32", "sft.lr=3e-3", "sft.lr_warmup_steps=2",
        "sft.max_steps=60", "sft.max_len=96", "data.max_prompt_len=32", "parallel.tp=2",
        "rollout.max_new_tokens=24", "algorithm.mini_batch_size=8",
        "actor.lr=1e-4", "critic.lr=1e-4", "actor.max_tokens_per_microbatch=256",
        "critic.max_tokens_per_microbatch=256", "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0",
        "trainer.total_steps=2", "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.tensorboard=false",
        f"trainer.run_dir={root / 'run'}",
        'algorithm.pag.verify_instruction="\\nV:\\n"', 'algorithm.pag.revise_instruction="\\nR:\\n"',
    ]
    return run_worker("scripts_pag.py", 2, root, config="algorithms/pag.yaml", overrides=overrides, timeout=900)


def test_trajectories_take_all_turns_with_instructions_between_them(result):
    from megarl.tasks.tiny_model import build_byte_tokenizer

    tok = build_byte_tokenizer()
    verify, revise = (tok.encode(s, add_special_tokens=False) for s in result["instructions"])
    trajs = result["components"]["trajectories"]
    assert len(trajs) == 8
    assert sum(t["turn_is_policy"] == [True, False, True] for t in trajs) >= 4  # the SFT taught "wrong" -> revise
    for t in trajs:
        ends, ids, tm = t["turn_ends"], t["response_ids"], t["template_mask"]
        assert len(ids) == len(tm) == len(t["engine_logprobs"]) == len(t["trainer_logprobs"]) and ends[-1] == len(ids) - 1
        want = [0] * (ends[0] + 1)
        for k in range(1, len(ends)):
            instr = verify if not t["turn_is_policy"][k] else revise
            assert ids[ends[k - 1] + 1 : ends[k - 1] + 1 + len(instr)] == instr
            want += [1] * len(instr) + [0] * (ends[k] - ends[k - 1] - len(instr))
        assert tm == want


def test_template_tokens_have_no_loss_and_no_value(result):
    for t in result["components"]["trajectories"]:
        for tmpl, loss, value in zip(t["template_mask"], t["loss_mask"], t["value_mask"]):
            assert (loss, value) == ((0.0, 0.0) if tmpl else (1.0, 1.0))


def test_engine_and_trainer_log_probs_agree_on_every_generated_token(result):
    worst, template_gap = logprob_gaps(result["components"]["trajectories"], "template_mask")
    assert worst < MISMATCH_MAX
    assert template_gap > 0.1  # so the mask, not luck, keeps them out of the mismatch
    m = result["components"]["mismatch"]
    assert m["rollout/logprob_mismatch"] < MISMATCH_MEAN and m["rollout/logprob_mismatch_max"] < MISMATCH_MAX


def test_turn_rewards_follow_the_checked_outcomes(result):
    for t in result["components"]["trajectories"]:
        for k, (pol, out) in enumerate(zip(t["turn_is_policy"], t["turn_outcome"])):
            assert out in ((0, 1) if pol else (-1, 0, 1))


def test_the_loop_trains_on_multi_turn_trajectories(result):
    rows = [r for r in result["loop"] if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_mismatch"] < MISMATCH_MEAN and r["rollout/logprob_mismatch_max"] < MISMATCH_MAX
        assert r["pag/revised_frac"] > 0 and 0.0 <= r["pag/verify_accuracy"] <= 1.0
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["critic/value_loss"])
