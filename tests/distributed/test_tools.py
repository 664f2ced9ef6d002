"""Tool-calling rollouts on megatron-core with 2 gloo ranks (TP=2, strict device mode;
tests/distributed/scripts_tools.py, chat-template tool calls): observation tokens carry no loss,
value, advantage or return; on every generated token of every turn the trainer's log-prob equals
the builtin engine's; a user tool given by dotted path is called with the parsed arguments; a
raising tool, a timing-out tool, a malformed call and a trajectory that runs into the turn budget
are each handled (an error observation, never the step's end) and counted; the RL loop trains on
such trajectories (critic, reference KL loss, entropy bonus)."""

import math

import pytest

from tests.distributed.launch import logprob_gaps, run_worker

# |engine - trainer| log-prob per generated token (fp32, CPU): the T-PPO / PAG gate
MISMATCH_MEAN, MISMATCH_MAX = 2e-6, 2e-5
TOOLS = "{add: tests.unit.tool_fixtures:add, boom: tests.unit.tool_fixtures:boom, slow: tests.unit.tool_fixtures:slow}"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    overrides = [
        f"model.hf_path={root / 'model'}", f"data.train_path={root / 'train.jsonl'}", "data.eval=[]",
        f"sft.data_path={root / 'sft.jsonl'}", "data.prompt_template=raw", "data.apply_chat_template=true",
        "data.max_prompt_len=64", "data.shuffle=false", "model.dtype=fp32", "model.transformer_impl=local", "parallel.tp=2",
        "reward.sources={arith: math}", "rollout.n_samples_per_prompt=4", "rollout.prompts_per_step=6",
        "rollout.max_new_tokens=96", "rollout.tools.format=chat_json", f"rollout.tools.functions={TOOLS}",
        "rollout.tools.max_turns=3", "rollout.tools.max_response_tokens=420", "rollout.tools.timeout_s=6",
        "algorithm.mini_batch_size=24", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001",
        "sft.batch_size=16", "sft.lr=5e-3", "sft.lr_warmup_steps=2", "sft.max_steps=200", "sft.max_len=480",
        "actor.lr=1e-5", "critic.lr=1e-4", "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0",
        "actor.max_tokens_per_microbatch=1024", "critic.max_tokens_per_microbatch=1024",
        "trainer.total_steps=2", "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.tensorboard=false",
        f"trainer.run_dir={root / 'run'}",
    ]
    return run_worker("scripts_tools.py", 2, root, config="algorithms/retool.yaml", overrides=overrides, timeout=900)


def generated_turns(t: dict) -> list[str]:
    """The trajectory's generated turns (the runs of response tokens between observations), as text
    (the byte tokenizer: a token is a byte; <|im_end|> is the tokenizer's id for it)."""
    from tests.unit.chat_templates import TINY_TOOLS, byte_tokenizer_with

    tok = byte_tokenizer_with(TINY_TOOLS)
    turns, cur = [], []
    for tid, obs in zip(t["response_ids"], t["obs_mask"]):
        if obs and cur:
            turns.append(cur)
            cur = []
        elif not obs:
            cur.append(tid)
    return [tok.decode(ids) for ids in turns + ([cur] if cur else [])]


def by_kind(result) -> dict[str, list[dict]]:
    """The trajectories of each prompt kind (scripts_tools.KINDS) whose turns began with exactly the
    SFT'd calls (sampled at temperature 1, a few write others: those are not checked here)."""
    from tests.distributed.scripts_tools import KINDS

    out = {k: [] for k in KINDS}
    for t in result["components"]["trajectories"]:
        for kind, (problem, _, turns) in KINDS.items():
            calls = [turn + "<|im_end|>" for turn in turns if turn.startswith("<tool_call>")]
            if t["prompt"].endswith(f"user\n{problem}<|im_end|>\n<|im_start|>assistant\n") and \
                    generated_turns(t)[: len(calls)] == calls:
                out[kind].append(t)
    return out


def test_every_path_of_the_loop_is_taken_handled_and_counted(result):
    kinds = by_kind(result)
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # the SFT'd model takes each path
    stats = lambda t: t["tool_stats"]  # noqa: E731
    for t in kinds["add"]:
        assert stats(t)["per_tool"]["add"] == {"calls": 1, "errors": 0, "timeouts": 0}
        assert "<tool_response>\n7\n</tool_response>" in t["text"]
    for t in kinds["python"]:
        assert stats(t)["per_tool"]["python"]["calls"] == 1 and "<tool_response>\n42\n</tool_response>" in t["text"]
    for t in kinds["boom"]:
        assert stats(t)["per_tool"]["boom"]["errors"] == 1 and "Error: RuntimeError: the tool crashed" in t["text"]
    for t in kinds["slow"]:
        assert stats(t)["per_tool"]["slow"]["timeouts"] == 1 and "Error: slow timed out after 6 s" in t["text"]
    for t in kinds["malformed"]:
        assert stats(t)["malformed"] == 1 and "Error: the tool call is not valid JSON" in t["text"]
    for t in kinds["loop"]:
        assert stats(t)["end"] == "turn_budget" and stats(t)["turns"] == 3 and stats(t)["calls"] == 2
    m = result["components"]["metrics"]
    assert m["tools/boom/error_rate"] == 1.0 and m["tools/slow/timeout_rate"] == 1.0
    assert m["tools/malformed_per_sample"] > 0 and m["tools/turn_budget_frac"] > 0
    assert m["tools/add/calls_per_sample"] > 0 and m["tools/python/calls_per_sample"] > 0


def test_a_user_tool_by_dotted_path_gets_the_parsed_arguments(result):
    calls = result["components"]["user_tool_calls"]
    assert calls and all(c == ["add", {"a": 3, "b": 4}] for c in calls)
    assert len(calls) == sum(t["tool_stats"]["per_tool"].get("add", {}).get("calls", 0)
                             for t in result["components"]["trajectories"])


def test_observation_tokens_have_no_loss_value_advantage_or_return(result):
    seen = 0
    for t in result["components"]["trajectories"]:
        for obs, loss, value, adv, ret in zip(t["obs_mask"], t["loss_mask"], t["value_mask"], t["advantages"], t["returns"]):
            if obs:
                seen += 1
                assert (loss, value, adv, ret) == (0.0, 0.0, 0.0, 0.0)
            else:
                assert (loss, value) == (1.0, 1.0)
    assert seen > 0


def test_engine_and_trainer_log_probs_agree_on_every_generated_token_of_every_turn(result):
    trajectories = result["components"]["trajectories"]
    turns = sum(t["tool_stats"]["turns"] for t in trajectories)
    worst, obs_gap = logprob_gaps(trajectories, "obs_mask")
    assert turns > len(result["components"]["trajectories"])  # multi-turn
    assert worst < MISMATCH_MAX
    assert obs_gap > 0.1  # so the mask, not luck, keeps them out of the comparison
    m = result["components"]["mismatch"]
    assert m["rollout/logprob_mismatch"] < MISMATCH_MEAN and m["rollout/logprob_mismatch_max"] < MISMATCH_MAX


def test_the_loop_trains_on_tool_trajectories(result):
    rows = [r for r in result["loop"] if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_mismatch"] < MISMATCH_MEAN and r["rollout/logprob_mismatch_max"] < MISMATCH_MAX
        assert r["tools/calls_per_sample"] > 0 and r["tools/obs_tokens"] > 0
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/value_loss", "critic/explained_variance"):
            assert math.isfinite(r[key]), key
