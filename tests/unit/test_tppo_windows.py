"""T-PPO successive batching with the real builtin engine and reward manager (one process): carried
samples continue their own response, freed slots take new prompts, samples over the staleness cap
restart or drop, and the in-flight samples survive a checkpoint round trip."""

import json

import pytest
import torch

from megarl.config import load_config
from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
from megarl.data.sampler import PromptSampler
from megarl.rewards import RewardConfig, RewardManager
from megarl.rollout.builtin import BuiltinEngine
from megarl.trainer.batch import Trajectory
from megarl.trainer.generation import RolloutWorker
from megarl.trainer.state import TrainerState
from megarl.trainer.windows import SuccessiveBatching, new_prompt_count, restarted, split_stale

N, PROMPTS, WINDOW, MAX_NEW = 2, 3, 3, 9


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from megarl.tasks.arith import write_task_files
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    root = tmp_path_factory.mktemp("windows")
    save_tiny_model(root / "model", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0))
    config = json.loads((root / "model" / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *range(48, 58), *range(65, 91)]  # ~0.1 stop chance per token
    (root / "model" / "config.json").write_text(json.dumps(config))
    paths = write_task_files(root / "task", n_sft=4, n_train=40, n_eval=2, seed=0)
    engine = BuiltinEngine.from_pretrained(root / "model")
    items = tokenize_dataset(load_prompt_dataset(paths["train"]), engine.tokenizer, template="arith",
                             max_prompt_len=32).items
    return engine, items


def collector(parts, *overrides):
    engine, items = parts
    cfg = load_config("configs/algorithms/tppo.yaml", [
        f"rollout.n_samples_per_prompt={N}", f"rollout.prompts_per_step={PROMPTS}", f"rollout.window_tokens={WINDOW}",
        f"rollout.max_new_tokens={MAX_NEW}", "algorithm.mini_batch_size=2", *overrides])
    rewards = RewardManager(RewardConfig.from_dict({"sources": {"arith": "math"}}))
    worker = RolloutWorker(engine, engine.tokenizer, rewards, cfg)
    sampler = PromptSampler(items, batch_prompts=PROMPTS, seed=0)

    def next_items(n):
        sampler.batch_prompts = n
        return sampler.next_batch()

    return worker, SuccessiveBatching(cfg, worker, next_items, lambda its: [list(i.prompt_ids) for i in its], items)


def run_steps(parts, steps, *overrides, with_state=False):
    """Per step (in-flight payloads before, the step's payloads, metrics, in-flight payloads after):
    the collector returns RowMetas; their payloads are in the worker's store (one process: all here)."""
    worker, collect = collector(parts, *overrides)
    state, out = TrainerState(), []
    payloads = lambda rows: [worker.store.get(m.key) for m in rows]  # noqa: E731
    for step in range(steps):
        before = payloads(state.in_flight)
        worker.policy_version = step  # as the loop's weight sync sets it
        rows, metrics = collect(step, state)
        assert all(m.response_len == len(t.response_ids) for m, t in zip(rows, payloads(rows)))
        out.append((before, payloads(rows), metrics, payloads(state.in_flight)))
    return (out, worker, state) if with_state else out


def test_carried_samples_continue_their_response_and_slots_refill(parts):
    steps = run_steps(parts, 4)
    assert any(m["rollout/continued_samples"] and m["rollout/new_samples"] for _, _, m, _ in steps[1:])
    for step, (before, trajs, m, after) in enumerate(steps):
        carried = trajs[: len(before)]  # one engine: the carried samples come first, in order
        for old, new in zip(before, carried):
            assert new.uid == old.uid and new.response_ids[: len(old.response_ids)] == old.response_ids
            assert new.rollout_logprobs[: len(old.rollout_logprobs)] == old.rollout_logprobs
            assert new.window_start == len(old.response_ids) and new.start_version == old.first_version
            assert 0 < len(new.response_ids) - new.window_start <= WINDOW
        for t in trajs[len(before):]:
            assert t.window_start == 0 and t.start_version == step and len(t.response_ids) <= WINDOW
        assert all(t.policy_version == step for t in trajs)
        assert m["rollout/new_samples"] == N * new_prompt_count(len(before), PROMPTS, N)
        assert len(trajs) == len(before) + m["rollout/new_samples"] <= N * PROMPTS
        assert after == [t for t in trajs if t.finish_reason == "truncated"]
        assert all(t.finish_reason in ("stop", "length") for t in trajs if t not in after)
        assert all(t.score == 0.0 and not t.acc for t in after)  # no reward before the response ends
        assert all(len(t.response_ids) <= MAX_NEW for t in trajs)


@pytest.mark.parametrize("action", ["restart", "drop"])
def test_samples_over_the_staleness_cap_restart_or_drop(parts, action):
    steps = run_steps(parts, 3, "rollout.max_staleness=1", f"rollout.stale_action={action}")
    before, trajs, m, _ = steps[2]
    stale = [t for t in before if t.first_version == 0]  # started at step 0: 2 versions old at step 2
    assert stale, "the fixture should leave a response unfinished after two windows"
    assert m["rollout/continued_samples"] == len(before) - len(stale)
    if action == "restart":
        assert m["rollout/restarted_samples"] == len(stale) and m["rollout/dropped_samples"] == 0
        redo = trajs[len(before) - len(stale): len(before)]
        assert [t.uid for t in redo] == [t.uid for t in stale]
        assert all(t.window_start == 0 and t.start_version == 2 and len(t.response_ids) <= WINDOW for t in redo)
    else:
        assert m["rollout/dropped_samples"] == len(stale) and m["rollout/restarted_samples"] == 0
        assert m["rollout/new_samples"] == N * new_prompt_count(len(before) - len(stale), PROMPTS, N)
    assert max(t.policy_version - t.first_version for t in trajs) <= 1


def test_pure_bookkeeping():
    ts = [Trajectory(str(i), [1], [2] * 3, [0.0] * 3, "truncated", policy_version=4, start_version=v)
          for i, v in enumerate([4, 2, 1])]
    keep, stale = split_stale(ts, 5, 3)
    assert [t.uid for t in keep] == ["0", "1"] and [t.uid for t in stale] == ["2"]
    assert split_stale(ts, 5, None) == (ts, [])
    r = restarted(ts[2], 5)
    assert (r.response_ids, r.rollout_logprobs, r.window_start, r.first_version, r.uid) == ([], [], 0, 5, "2")
    assert [new_prompt_count(a, 4, 3) for a in (0, 5, 10, 12, 20)] == [4, 2, 0, 0, 0]


def test_in_flight_samples_survive_a_checkpoint_round_trip(parts, tmp_path):
    """The metas in trainer_state.pt, the payloads in rows/rank0.pt (megarl.trainer.rows)."""
    from megarl.trainer.rows import RowStore, rank_rows, restore_rows

    steps, worker, state = run_steps(parts, 2, with_state=True)
    assert state.in_flight
    torch.save(state.state_dict(), tmp_path / "trainer_state.pt")
    (tmp_path / "rows").mkdir()
    torch.save(rank_rows(worker.store, state.carried_rows, 0), tmp_path / "rows" / "rank0.pt")
    loaded, store = TrainerState(), RowStore()
    loaded.load_state_dict(torch.load(tmp_path / "trainer_state.pt", weights_only=True))
    loaded.remap(restore_rows(tmp_path, store, 0, 1))
    assert [(m.uid, m.response_len, m.window_start) for m in loaded.in_flight] == \
        [(m.uid, m.response_len, m.window_start) for m in state.in_flight]
    assert [store.get(m.key) for m in loaded.in_flight] == steps[-1][3]  # the payloads, field by field
    assert len(store) == len(state.in_flight)  # only the carried rows were saved


def test_a_tail_minibatch_smaller_than_dp_joins_the_previous_one():
    """T-PPO batches vary in size (9 here, mini-batches of 4): no DP rank may get an empty mini-batch."""
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch

    batch = StepBatch.from_trajectories([Trajectory(str(i), [1], [2] * (i + 1), [0.0] * (i + 1), "stop")
                                         for i in range(9)])
    shares = [rl.split_minibatches(batch.lengths, 4, 0, r, 2) for r in (0, 1)]
    assert [len(mbs) for mbs in shares] == [2, 2] and all(mb for mbs in shares for mb in mbs)
    assert sorted(i for mbs in shares for mb in mbs for i in mb) == list(range(9))
    assert sorted(len(a) + len(b) for a, b in zip(*shares)) == [4, 5]
    assert [len(mb) for mb in rl.split_minibatches(batch.lengths, 4, 0, 0, 1)] == [4, 4, 1]  # one rank: unchanged


def test_tppo_preset_settings():
    """docs/algorithms.md §5: windows of 8K, responses up to 24K, 512 x 16, mini-batch 512, no KL; EGAE with
    Monte-Carlo critic targets; VAPO's values where the paper is silent."""
    c = load_config("configs/algorithms/tppo.yaml")
    a, r = c.algorithm, c.rollout
    assert (a.name, a.advantage, a.lam_critic, a.kl_coef, a.mini_batch_size) == ("tppo", "egae", 1.0, 0.0, 512)
    assert (r.window_tokens, r.max_new_tokens, r.prompts_per_step, r.n_samples_per_prompt) == (8192, 24576, 512, 16)
    assert (a.clip_low, a.clip_high, c.actor.lr, c.critic.lr, a.value_pretrain_steps) == (0.2, 0.28, 1e-6, 2e-6, 50)
    assert not a.retrain_earlier_windows and c.critic.enable


@pytest.mark.parametrize("overrides, field", [
    (["rollout.window_tokens=8192", "rollout.max_new_tokens=8192"], "rollout.window_tokens"),
    (["algorithm.advantage=gae"], "rollout.window_tokens"),
    (["algorithm.dynamic_sampling=true"], "rollout.window_tokens"),
    (["rollout.fire=true"], "rollout.window_tokens"),
    (["rollout.window_tokens=null"], "algorithm.name"),
    (["rollout.max_staleness=0"], "rollout.max_staleness"),
])
def test_bad_window_settings_fail_at_load_naming_the_field(overrides, field):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("configs/algorithms/tppo.yaml", overrides)
