"""PAG multi-turn rollout bookkeeping (megarl/rollout/multi_turn.py) against hand-computed layouts:
a scripted engine (the RolloutEngine generate interface, fixed turn texts) for the pure
bookkeeping, and the real builtin engine for the token-level continuation."""

from __future__ import annotations

import pytest

from megarl.rollout import SamplingParams
from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG, parse_verdict, pag_rollout
from tests.unit import scripted_engine
from tests.unit.scripted_engine import decode, ids

V, R = [90, 91], [80]  # verify / revise instruction tokens


def ScriptedEngine(script: list[list[str]], max_context: int | None = None):  # noqa: N802 (stands for the class)
    """The scripted engine with every turn text whole (the PAG scripts fix each turn's text)."""
    return scripted_engine.ScriptedEngine(script, max_context, truncate=False)


def test_parse_verdict_takes_exactly_one_phrase():
    assert parse_verdict("7+6 ok\nThe answer is correct") == 1
    assert parse_verdict("3+8+1=13 is a wrong step. The answer is wrong.") == 0
    assert parse_verdict("all steps fine") == -1  # missing
    assert parse_verdict("The answer is correct\nThe answer is correct") == -1  # duplicated
    assert parse_verdict(f"{VERDICT_WRONG} ... {VERDICT_CORRECT}") == -1  # both
    assert parse_verdict("the answer is correct") == -1  # the phrase is case-sensitive


def test_turn_layout_masks_and_log_probs_by_hand():
    """2 prompts x n=2: correct -> stop; wrong -> revise (T_max 2: no further verification);
    missing and duplicated verdicts -> stop. One call per turn kind, contexts = all so far + instruction."""
    script = [
        ["s0", "s1", "s2", "s3"],                                       # first turns (prompt-major)
        [VERDICT_CORRECT, VERDICT_WRONG, "no verdict", VERDICT_WRONG + VERDICT_WRONG],  # all verifications
        ["r1"],                                                         # the one revision
    ]
    engine = ScriptedEngine(script)
    out = pag_rollout(engine, [[1, 2], [3]], SamplingParams(n=2, seed=5, max_new_tokens=30), V, R, 2, decode)
    assert [t.index for t in out] == [0, 0, 1, 1]
    t0, t1, t2, t3 = out
    # t0: s0 | V VERDICT_CORRECT
    assert t0.response_ids == ids("s0") + V + ids(VERDICT_CORRECT)
    assert t0.template_mask == [0, 0, 1, 1] + [0] * 21
    assert t0.turn_ends == [1, 24] and t0.turn_is_policy == [True, False] and t0.verdicts == [None, 1]
    assert t0.logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0] + [-0.1 * (i + 1) for i in range(21)])
    # t1: s1 | V VERDICT_WRONG | R r1
    assert t1.response_ids == ids("s1") + V + ids(VERDICT_WRONG) + R + ids("r1")
    assert t1.template_mask == [0, 0, 1, 1] + [0] * 19 + [1, 0, 0]
    assert t1.turn_ends == [1, 22, 25] and t1.turn_is_policy == [True, False, True] and t1.verdicts == [None, 0, None]
    assert t1.logprobs[-3:] == pytest.approx([0.0, -0.1, -0.2])
    assert t1.turn_texts == ["s1", VERDICT_WRONG, "r1"]
    # t2 / t3: missing and duplicated verdicts end the trajectory
    assert t2.verdicts == [None, -1] and t3.verdicts == [None, -1] and t2.turn_ends == [1, 2 + 2 + 10 - 1]
    # batching: 3 calls; first n=2 on the prompts, then n=1 on the continued contexts
    (c0, p0), (c1, p1), (c2, p2) = engine.calls
    assert c0 == [[1, 2], [3]] and p0.n == 2
    assert c1 == [[1, 2] + ids("s0") + V, [1, 2] + ids("s1") + V, [3] + ids("s2") + V, [3] + ids("s3") + V]
    assert c2 == [[1, 2] + ids("s1") + V + ids(VERDICT_WRONG) + R]
    assert p1.n == p2.n == 1 and [p0.seed, p1.seed, p2.seed] == [5, 5 + 7919, 5 + 2 * 7919]


def test_selective_revision_stops_on_correct_and_at_t_max():
    """T_max 3: wrong -> revise -> verify again; "correct" stops after 2 policy turns; wrong twice
    gives the 3rd policy turn, which is not verified."""
    script = [["a", "b"], [VERDICT_WRONG, VERDICT_WRONG], ["a2", "b2"], [VERDICT_CORRECT, VERDICT_WRONG], ["b3"]]
    engine = ScriptedEngine(script)
    a, b = pag_rollout(engine, [[7], [8]], SamplingParams(n=1), V, R, 3, decode)
    assert a.turn_is_policy == [True, False, True, False] and a.verdicts == [None, 0, None, 1]
    assert b.turn_is_policy == [True, False, True, False, True] and b.verdicts == [None, 0, None, 0, None]
    assert b.turn_texts[-1] == "b3" and len(engine.calls) == 5
    assert b.turn_ends == [0, 0 + 2 + 19, 21 + 1 + 2, 24 + 2 + 19, 45 + 1 + 2]  # "b", V+verdict, R+"b2", ...
    # T_max 1: the first attempt only, no verification
    single = pag_rollout(ScriptedEngine([["x"]]), [[7]], SamplingParams(n=1), V, R, 1, decode)
    assert single[0].turn_is_policy == [True] and single[0].template_mask == [0]


def test_routed_experts_of_every_position_come_from_the_call_that_forwarded_it():
    """Routing replay through PAG turns (megarl.rollout.multi_turn.stitch_routing): each position
    keeps the experts of the first call that forwarded it (a turn's last token and the instruction
    after it: the next call's)."""
    script = [["a", "b"], [VERDICT_WRONG, VERDICT_WRONG], ["a2", "b2"], [VERDICT_CORRECT, VERDICT_WRONG], ["b3"]]
    engine = scripted_engine.ScriptedEngine(script, truncate=False, routing=(2, 2))
    a, b = pag_rollout(engine, [[7], [8]], SamplingParams(n=1), V, R, 3, decode)
    for t in (a, b):
        total = 1 + len(t.response_ids)
        ends = [1 + e + 1 for e in t.turn_ends]
        calls = [c for c, (contexts, _) in enumerate(engine.calls)
                 for ctx in contexts if ctx[0] == t.prompt_ids[0]]  # the calls this trajectory took part in
        got = t.routed_experts[:, 1, 0].tolist()
        assert t.routed_experts.shape == (total, 2, 2)
        assert got == [calls[c] if c >= 0 else -1 for c in scripted_engine.first_forwards(ends, total)]
    assert set(b.routed_experts[:, 0, 0].tolist()) == {0, 1, 2, 3, 4, -1}


def test_a_turn_that_would_not_fit_the_context_ends_the_trajectory():
    """engine.max_context: prompt 1 + "abc" 3 + V 2 = 6 >= 6 leaves no room -> "length", no call."""
    engine = ScriptedEngine([["ab", "abc"], [VERDICT_WRONG]], max_context=6)
    short, long_ = pag_rollout(engine, [[1], [2]], SamplingParams(n=1), V, R, 2, decode)
    assert long_.turn_ends == [2] and long_.finish_reason == "length"
    assert short.verdicts == [None, 0] and short.finish_reason == "length"  # the revision did not fit either
    assert len(engine.calls) == 2 and len(engine.calls[1][0]) == 1


def test_builtin_engine_turns_continue_the_whole_context(tmp_path):
    """With the real builtin engine (greedy), the verification turn is what the engine generates from
    prompt + solution + instruction, and its log-probs sit at its own positions."""
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=3))
    engine = BuiltinEngine.from_pretrained(tmp_path / "m")
    tok = engine.tokenizer
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=0)
    verify, revise = tok.encode("\nCheck.\n"), tok.encode("\nAgain.\n")
    prompts = [tok.encode("Q: 12+34=?\n"), tok.encode("Q: 5+6=?\n")]
    out = pag_rollout(engine, prompts, sp, verify, revise, 2, lambda x: tok.decode(x))
    first = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    for t in out:
        sol = first[t.index]
        assert t.response_ids[: len(sol.response_ids)] == sol.response_ids
        ctx = t.prompt_ids + sol.response_ids + verify
        ver = engine.generate([ctx], SamplingParams(n=1, temperature=0.0, max_new_tokens=5))[0]
        start = len(sol.response_ids) + len(verify)
        assert t.response_ids[start : t.turn_ends[1] + 1] == ver.response_ids
        assert t.logprobs[start : t.turn_ends[1] + 1] == pytest.approx(ver.logprobs, abs=1e-6)
        assert t.template_mask[len(sol.response_ids) : start] == [1] * len(verify)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.template_mask) if m)
        assert len(t.response_ids) == len(t.logprobs) == len(t.template_mask)
