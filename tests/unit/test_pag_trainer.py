"""PAG in the trainer (megarl/trainer/pag.py + its hooks in rollout / batch / ppo): per-turn scoring
with the real math verifier, masks, turn-independent GAE + RoleAdvNorm advantages against
closed forms (gamma = lambda = 1), RoleAdvNorm's DP reduction, metrics, config checks, and the
RolloutWorker switch with the real builtin engine."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.masked import masked_whiten_by_role
from megarl.config import ConfigError, load_config
from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG, MultiTurnSample
from megarl.trainer import pag, rl
from megarl.trainer.batch import StepBatch, Trajectory

PRESET = "configs/algorithms/pag.yaml"


def two_trajectories() -> list[Trajectory]:
    """A: y1 (wrong) | V v1 ("wrong": right) | R y2 (correct): rewards 0, 1, 1 + alpha * (1 - 0).
    B: y1 (correct) | V v1 ("wrong": wrong): rewards 1, 0."""
    a = Trajectory(uid="0", prompt_ids=[5, 6], response_ids=[11, 12, 90, 91, 13, 14, 80, 15, 16],
                   rollout_logprobs=[-0.5] * 9, finish_reason="stop", template_mask=[0, 0, 1, 1, 0, 0, 1, 0, 0],
                   turn_ends=[1, 5, 8], turn_is_policy=[True, False, True], turn_outcome=[0, 0, 1])
    b = Trajectory(uid="1", prompt_ids=[7], response_ids=[21, 22, 90, 91, 23], rollout_logprobs=[-0.5] * 5,
                   finish_reason="stop", template_mask=[0, 0, 1, 1, 0], turn_ends=[1, 4],
                   turn_is_policy=[True, False], turn_outcome=[1, 0])
    return [a, b]


def advantages(overrides: list[str]) -> tuple[StepBatch, torch.Tensor]:
    cfg = load_config(PRESET, overrides)
    batch = StepBatch.from_trajectories(two_trajectories())
    rl.set_masks(batch, cfg)
    values = torch.linspace(-0.4, 0.6, batch.width).expand(len(batch), -1) * batch.response_mask
    batch.values = values.clone()
    rl.compute_advantages(batch, batch, [0, 1], cfg, None, 0.0)
    return batch, values


GEN_A, GEN_B = [0, 1, 4, 5, 7, 8], [0, 1, 4]  # generated (non-template) positions
ROLE_A, ROLE_B = [0, 0, 1, 1, 0, 0], [0, 0, 1]  # 0 policy, 1 verifier


def expected_whitened(raw: dict, roles: dict, per_role: bool) -> dict:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the generated tokens of each role (or all)."""
    keys = [(r, j) for r in raw for j in range(len(raw[r]))]
    groups = {0: [], 1: []}
    for r, j in keys:
        groups[roles[r][j] if per_role else 0].append(raw[r][j])
    stats = {g: (torch.tensor(v).mean(), torch.tensor(v).var()) for g, v in groups.items() if v}
    out = {r: [0.0] * len(raw[r]) for r in raw}
    for r, j in keys:
        m, v = stats[roles[r][j] if per_role else 0]
        out[r][j] = float((raw[r][j] - m) / torch.sqrt(v + 1e-8))
    return out


def test_masks_leave_template_tokens_out_of_loss_and_value():
    batch, _ = advantages([])
    template = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    response = torch.tensor([[1.0] * 9, [1.0] * 5 + [0.0] * 4])
    assert torch.equal(batch.loss_mask, response * (1 - template))
    assert torch.equal(batch.value_mask, response * (1 - template))
    assert torch.equal(batch.advantages * template, torch.zeros_like(template))
    assert torch.equal(batch.returns * template, torch.zeros_like(template))


@pytest.mark.parametrize("alpha", [1.0, 2.5])
def test_turn_independent_gae_with_role_adv_norm_matches_the_closed_form(alpha):
    """gamma = lambda = 1 and turn-independent: A_t = R(turn of t) - V_t, returns_t = R(turn of t);
    then whitened per role over the generated tokens."""
    batch, v = advantages([f"algorithm.pag.alpha={alpha}"])
    turn_reward_a = {0: 0.0, 1: 0.0, 4: 1.0, 5: 1.0, 7: 1.0 + alpha, 8: 1.0 + alpha}
    turn_reward_b = {0: 1.0, 1: 1.0, 4: 0.0}
    raw = {0: [turn_reward_a[t] - float(v[0, t]) for t in GEN_A], 1: [turn_reward_b[t] - float(v[1, t]) for t in GEN_B]}
    want = expected_whitened(raw, {0: ROLE_A, 1: ROLE_B}, per_role=True)
    assert batch.advantages[0, GEN_A].tolist() == pytest.approx(want[0], abs=1e-5)
    assert batch.advantages[1, GEN_B].tolist() == pytest.approx(want[1], abs=1e-5)
    assert batch.returns[0, GEN_A].tolist() == pytest.approx([turn_reward_a[t] for t in GEN_A], abs=1e-6)
    assert batch.returns[1, GEN_B].tolist() == pytest.approx([turn_reward_b[t] for t in GEN_B], abs=1e-6)


def test_turn_independent_and_role_adv_norm_switches():
    """turn_independent=false: one GAE over the trajectory (A_t = rewards from t to the end - V_t);
    role_adv_norm=false: whitened over both roles together."""
    batch, v = advantages(["algorithm.pag.turn_independent=false", "algorithm.pag.role_adv_norm=false"])
    later_a = {0: 3.0, 1: 3.0, 4: 3.0, 5: 3.0, 7: 2.0, 8: 2.0}  # rewards 0 (t1), 1 (t5), 2 (t8)
    later_b = {0: 1.0, 1: 1.0, 4: 0.0}
    raw = {0: [later_a[t] - float(v[0, t]) for t in GEN_A], 1: [later_b[t] - float(v[1, t]) for t in GEN_B]}
    want = expected_whitened(raw, {0: ROLE_A, 1: ROLE_B}, per_role=False)
    assert batch.advantages[0, GEN_A].tolist() == pytest.approx(want[0], abs=1e-5)
    assert batch.advantages[1, GEN_B].tolist() == pytest.approx(want[1], abs=1e-5)
    per_role, _ = advantages(["algorithm.pag.turn_independent=false"])
    assert not torch.allclose(per_role.advantages, batch.advantages, atol=1e-3)


def test_role_adv_norm_with_dp_reduced_moments_equals_one_rank():
    """Rows split over 2 DP ranks, per-role moments summed (the all-reduce), each rank whitens its
    rows: the same as masked_whiten_by_role over the whole batch."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(6, 10, generator=g)
    mask = (torch.rand(6, 10, generator=g) > 0.3).float()
    roles = torch.randint(0, 2, (6, 10), generator=g)
    roles[:, 8:] = -1  # after the last turn
    whole = masked_whiten_by_role(adv, mask * (roles >= 0), roles)
    halves = [slice(0, 2), slice(2, 6)]  # uneven shares
    moments = sum(pag.role_moments(adv[h], mask[h], roles[h]) for h in halves)
    split = torch.cat([pag.whiten_by_role(adv[h], roles[h], moments) for h in halves])
    on = (mask * (roles >= 0)).bool()
    assert torch.allclose(split[on], whole[on], atol=1e-6)
    one_rank = pag.whiten_by_role(adv, roles, pag.role_moments(adv, mask, roles))
    assert torch.allclose(split, one_rank, atol=1e-6)


def sample(turns: list[tuple[str, bool]]) -> MultiTurnSample:
    s = MultiTurnSample(prompt_ids=[1, 2], index=0)
    for k, (text, is_policy) in enumerate(turns):
        s.add_turn([] if k == 0 else [9], [ord(c) for c in text], [-0.3] * len(text), is_policy, text, "stop")
    return s


def score(overrides: list[str]):
    from megarl.data.dataset import PromptItem
    from megarl.trainer.build import build_rewards
    from megarl.trainer.generation import RolloutWorker

    cfg = load_config(PRESET, ["reward.sources={arith: math}", *overrides])
    worker = RolloutWorker(None, None, build_rewards(cfg), cfg)
    items = [PromptItem(uid="q7", prompt="3+4", answer="7", data_source="arith")]
    samples = [sample([("3+4=8\nAnswer: 8", True), ("3+4=7 vs 8\n" + VERDICT_WRONG, False), ("x" * 20 + "\nAnswer: 7", True)]),
               sample([("Answer: 7", True), ("ok " + VERDICT_CORRECT, False)]),
               sample([("Answer: 7", True), ("no verdict", False)])]
    return pag.score(worker, items, samples)


def test_score_checks_every_policy_turn_and_sums_the_turn_rewards():
    trajs, metrics = score([])
    a, b, c = trajs
    assert a.turn_outcome == [0, 0, 1] and a.acc and a.score == pytest.approx(0 + 1 + (1 + 1.0 * (1 - 0)))
    assert b.turn_outcome == [1, 1] and b.acc and b.score == pytest.approx(1 + 1)
    assert c.turn_outcome == [1, -1] and c.acc and c.score == pytest.approx(1 + 0)  # missing verdict: R_v = 0
    assert metrics["reward/count"] == 4.0 and metrics["reward/correct"] == 3.0  # the 4 policy turns
    # turns of 15, 30 and 30 characters (one token each), each later turn after its 1-token instruction
    assert a.template_mask == [0] * 15 + [1] + [0] * 30 + [1] + [0] * 30 and a.turn_ends == [14, 15 + 30, 46 + 30]
    assert a.uid == "q7" and a.data_source == "arith"
    # alpha scales the revision bonus; a short answer tail cuts "Answer: 7" of the 30-char revision off
    assert score(["algorithm.pag.alpha=3"])[0][0].score == pytest.approx(0 + 1 + (1 + 3.0))
    short = score(["algorithm.pag.answer_tail_chars=5"])[0]
    assert short[0].turn_outcome == [0, 0, 0] and short[1].turn_outcome == [0, 1]  # a verdict is not cut


def test_turn_stats_by_hand():
    trajs, _ = score([])
    stats = pag.turn_stats(trajs)
    # first: 0, 1, 1; final: 1, 1, 1; verifier turns: "wrong" on a wrong answer (right), "correct" on a
    # correct one (right), missing (wrong)
    # on correct answers: "correct" (right) and missing (wrong); on the wrong one: "wrong" (right)
    assert stats == pytest.approx({"first_accuracy": 2 / 3, "final_accuracy": 1.0, "verify_accuracy": 2 / 3,
                                   "verify_on_correct": 1 / 2, "verify_on_wrong": 1.0,
                                   "revised_frac": 1 / 3, "verdict_missing_frac": 1 / 3, "verdict_correct_frac": 1 / 3})
    assert pag.eval_metrics(trajs, "eval/x")["eval/x/verify_accuracy"] == pytest.approx(2 / 3)
    single = Trajectory(uid="u", prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop")
    assert pag.turn_stats([single]) == {} and pag.eval_metrics([single], "eval/x") == {}


def test_instructions_come_from_the_config():
    """The ids pag_rollout appends before verifications / revisions (tests/unit/test_pag_rollout.py
    shows where) are the tokenizer's encoding of algorithm.pag.verify_instruction / revise_instruction."""
    from megarl.tasks.tiny_model import build_byte_tokenizer

    tok = build_byte_tokenizer()
    cfg = load_config(PRESET, ["algorithm.pag.verify_instruction=Check!", "algorithm.pag.revise_instruction=Again"])
    assert pag.instructions(cfg, tok) == ([ord(c) for c in "Check!"], [ord(c) for c in "Again"])
    default = pag.instructions(load_config(PRESET), tok)
    assert len(default[0]) == len(load_config(PRESET).algorithm.pag.verify_instruction)


def test_config_checks_name_the_field():
    with pytest.raises(ConfigError, match=r"algorithm\.advantage.*needs the critic estimator gae"):
        load_config(PRESET, ["algorithm.advantage=grpo"])
    with pytest.raises(ConfigError, match=r"algorithm\.pag\.role_adv_norm.*whiten_advantages"):
        load_config(PRESET, ["algorithm.whiten_advantages=false"])
    with pytest.raises(ConfigError, match=r"algorithm\.pag\.max_policy_turns"):
        load_config(PRESET, ["algorithm.pag.max_policy_turns=0"])
    with pytest.raises(ConfigError, match=r"actor\.max_tokens_per_microbatch"):  # 3 turns of 2048 + instructions
        load_config(PRESET, ["actor.max_tokens_per_microbatch=8192"])
    load_config(PRESET, ["algorithm.whiten_advantages=false", "algorithm.pag.role_adv_norm=false"])


def test_worker_generates_multi_turn_trajectories_when_enabled(tmp_path):
    """RolloutWorker with the real builtin engine: algorithm.pag.enable gives solution + instruction +
    verification trajectories (the untrained model never says "wrong": no revision); max_policy_turns=1
    gives the first attempt only; disabled gives single-turn samples."""
    import torch.distributed as dist

    from megarl.data.dataset import PromptItem
    from megarl.rollout import SamplingParams
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model
    from megarl.trainer.build import build_rewards
    from megarl.trainer.generation import RolloutWorker

    save_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64))
    engine = BuiltinEngine.from_pretrained(tmp_path / "m")
    items = [PromptItem(uid=f"u{i}", prompt=f"{i}+{i}", answer=str(2 * i), data_source="arith") for i in range(2)]
    encoded = [engine.tokenizer.encode(f"Q: {it.prompt}=?\n") for it in items]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)

    def run(overrides):
        cfg = load_config(PRESET, ["reward.sources={arith: math}", 'algorithm.pag.verify_instruction="\\nCheck.\\n"',  # YAML-quoted: keeps the newlines

                                   *overrides])
        worker = RolloutWorker(engine, engine.tokenizer, build_rewards(cfg), cfg)
        rows = worker.generate(items, encoded, sp)  # RowMetas; the payloads stay in the worker's store
        return [worker.store.get(m.key) for m in rows], worker.metrics

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        on, metrics = run([])
        first_only, _ = run(["algorithm.pag.max_policy_turns=1"])
        off, _ = run(["algorithm.pag.enable=false"])
    finally:
        if owned:
            dist.destroy_process_group()
    check = engine.tokenizer.encode("\nCheck.\n")
    for t in on:
        assert t.turn_is_policy == [True, False] and t.turn_outcome[1] == -1
        start = t.turn_ends[0] + 1
        assert t.response_ids[start : start + len(check)] == check and t.template_mask[start : start + len(check)] == [1] * len(check)
        assert sum(t.template_mask) == len(check) and len(t.response_ids) == len(t.rollout_logprobs)
    assert metrics["pag/verdict_missing_frac"] == 1.0 and "pag/first_accuracy" in metrics
    assert all(t.turn_is_policy == [True] and sum(t.template_mask) == 0 for t in first_only)
    assert all(t.turn_ends is None and t.template_mask is None for t in off)
    assert StepBatch.from_trajectories(off).template_mask is None
