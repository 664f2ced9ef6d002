"""Tool-calling rollouts (megarl/rollout/tool_calls.py, tool_loop.py) against hand-computed layouts:
the two call formats, and the loop's bookkeeping with a scripted engine (the RolloutEngine
generate interface, fixed turn texts): observation tokens, masks, log-probs, contexts, budgets,
the ends of a trajectory, and malformed calls."""

from __future__ import annotations

import json

import pytest

from megarl.rollout import SamplingParams
from megarl.rollout.tool_calls import ChatJsonFormat, CodeFormat, ToolCall, ToolResult
from megarl.rollout.tool_loop import tool_rollout
from tests.unit.chat_templates import QWEN2_5, QWEN3, byte_tokenizer_with
from tests.unit.scripted_engine import ScriptedEngine, decode, ids


class EchoTools:
    """Executor: `python` calls answer `out:<code>`; records the requests."""

    def __init__(self):
        self.requests = []

    def __call__(self, requests):
        self.requests.append(requests)
        return [ToolResult(r.call.name, f"out:{r.call.arguments.get('code')}") if r.call.error is None
                else ToolResult("?", f"Error: {r.call.error}", "malformed") for r in requests]


# ------------------------------------------------------------------------------------- formats

def test_code_format_reads_the_block_the_turn_ends_with():
    f = CodeFormat()
    assert f.parse("just an answer\nAnswer: 12") == []
    (call,) = f.parse("let me compute <code>\nprint(3*4)\n</code>")
    assert (call.name, call.arguments, call.error) == ("python", {"code": "print(3*4)"}, None)
    (call,) = f.parse("<code>\n```python\nx = 2\nprint(x)\n```\n</code>")
    assert call.arguments == {"code": "x = 2\nprint(x)"}  # the markdown fence inside is dropped
    assert f.parse("oops </code>")[0].error and f.parse("<code> \n</code>")[0].error
    assert f.stop == ["</code>"]
    assert f.observation([ToolResult("python", "12\n")]) == "\n<interpreter>\n12\n</interpreter>\n"


def test_chat_json_format_reads_every_call_and_names_what_is_malformed():
    f = ChatJsonFormat(byte_tokenizer_with(QWEN2_5))
    text = ('I will call.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>')
    a, b = f.parse(text)
    assert (a.name, a.arguments, a.error) == ("python", {"code": "print(1)"}, None)
    assert (b.name, b.arguments) == ("search", {"q": "x"})  # arguments given as a JSON string
    assert f.parse("no calls here") == []
    for bad in ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "<tool_call>not json</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "x"'):
        (call,) = f.parse(bad)
        assert call.error, bad


@pytest.mark.parametrize("template", [QWEN2_5, QWEN3], ids=["qwen2.5", "qwen3"])
def test_chat_json_observation_is_the_templates_own_tool_turn(template):
    tok = byte_tokenizer_with(template)
    f = ChatJsonFormat(tok, tools=[{"type": "function", "function": {"name": "python", "parameters": {}}}])
    turn = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call><|im_end|>'
    obs = f.observation([ToolResult("python", "42")], turn)
    assert obs == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    two = f.observation([ToolResult("python", "1"), ToolResult("python", "2")], turn)
    assert two.count("<tool_response>") == 2 and two.count("<|im_start|>user") == 1
    # a turn cut before its end-of-turn token gets the whole closing text
    assert f.observation([ToolResult("python", "42")], "x").startswith("<|im_end|>\n<|im_start|>user")


# ------------------------------------------------------------------------------------- the loop

def test_turns_observations_masks_and_contexts_by_hand():
    """2 prompts x n=2: call -> answer; answer at once; call -> call -> answer; malformed -> answer."""
    engine = ScriptedEngine([
        ["a<code>1</code>", "Answer: 5", "b<code>2</code>", "c</code>"],   # first turns, prompt-major
        ["Answer: 1", "d<code>3</code>", "Answer: 9"],                      # the 3 that called (incl. malformed)
        ["Answer: 3"],
    ])
    tools = EchoTools()
    prompts = [ids("P1"), ids("P2")]
    out = tool_rollout(engine, prompts, SamplingParams(n=2, seed=5, max_new_tokens=300), CodeFormat(), tools,
                       max_turns=4, encode=ids, decode=decode)
    obs = lambda text: ids(f"\n<interpreter>\n{text}\n</interpreter>\n")  # noqa: E731
    t0, t1, t2, t3 = out
    assert [t.index for t in out] == [0, 0, 1, 1]
    assert t0.response_ids == ids("a<code>1</code>") + obs("out:1") + ids("Answer: 1")
    assert t0.obs_mask == [0] * 15 + [1] * len(obs("out:1")) + [0] * 9
    assert t0.logprobs[15: 15 + len(obs("out:1"))] == [0.0] * len(obs("out:1"))  # appended, not sampled
    assert t0.logprobs[:2] == pytest.approx([-0.1, -0.2]) and t0.turn_ends == [14, len(t0.response_ids) - 1]
    assert (t0.end, t0.turns, t0.answer_text) == ("answer", 2, "a<code>1</code>Answer: 1")
    assert (t1.end, t1.turns, t1.calls, t1.obs_tokens) == ("answer", 1, [], 0)
    assert t2.turns == 3 and [r.text for _, r in t2.calls] == ["out:2", "out:3"] and t2.call_turns == [0, 1]
    (call, res), = t3.calls
    assert call.error and res.status == "malformed" and t3.end == "answer"  # answered with the error, then goes on
    assert "Error: </code> without an opening <code>" in decode(t3.response_ids)
    # round 2 continues the 3 calling trajectories on their whole contexts, n = 1; round 3 only t2
    assert engine.calls[1][0] == [p + t.response_ids[: t.turn_ends[0] + 1] + obs(r.text) if r.status == "ok"
                                  else p + t.response_ids[: t.turn_ends[0] + 1] + obs(r.text)
                                  for p, t, (_, r) in ((prompts[0], t0, t0.calls[0]), (prompts[1], t2, t2.calls[0]),
                                                       (prompts[1], t3, t3.calls[0]))]
    assert [c[1].n for c in engine.calls] == [2, 1, 1] and [c[1].seed for c in engine.calls] == [5, 5 + 7919, 5 + 2 * 7919]
    assert all(c[1].stop == ["</code>"] for c in engine.calls)
    # the executor saw each round's calls together, each with its trajectory's history
    assert [len(r) for r in tools.requests] == [3, 1]
    assert tools.requests[1][0].history == t2.calls[:1]


def test_turn_budget_length_and_response_budget_end_a_trajectory():
    engine = ScriptedEngine([["<code>1</code>", "<code>2</code>", "abc~", "<code>9</code>"],
                             ["<code>3</code>", "<code>4</code>", "<code>x</code>"]])
    out = tool_rollout(engine, [[1]], SamplingParams(n=4, max_new_tokens=50), CodeFormat(), EchoTools(),
                       max_turns=2, encode=ids, decode=decode, budget=200)
    assert [t.end for t in out] == ["turn_budget", "turn_budget", "length", "turn_budget"]
    assert all(t.turns <= 2 for t in out) and out[2].finish_reason == "length"
    assert len(out[0].calls) == 1  # the call of the last allowed turn is not run
    # a budget the observation does not fit: the trajectory ends after its calling turn, nothing appended
    engine = ScriptedEngine([["<code>1</code>"]])
    (t,) = tool_rollout(engine, [[1]], SamplingParams(n=1, max_new_tokens=50), CodeFormat(), EchoTools(),
                        max_turns=4, encode=ids, decode=decode, budget=30)
    assert t.end == "response_budget" and t.obs_tokens == 0 and len(engine.calls) == 1
    # the engine's context counts too
    engine = ScriptedEngine([["<code>1</code>"]], max_context=30)
    (t,) = tool_rollout(engine, [[1]], SamplingParams(n=1, max_new_tokens=20), CodeFormat(), EchoTools(),
                        max_turns=4, encode=ids, decode=decode, budget=1000)
    assert t.end == "response_budget"


def test_a_turn_past_its_budget_is_cut_to_it():
    """The second turn gets at most the largest budget left; a sample past its own is cut ("length")."""
    engine = ScriptedEngine([["<code>1</code>", "<code>22</code>"], ["x" * 40, "y" * 40]])
    a, b = tool_rollout(engine, [[1]], SamplingParams(n=2, max_new_tokens=40), CodeFormat(), EchoTools(),
                        max_turns=3, encode=ids, decode=decode, budget=60)
    assert engine.calls[1][1].max_new_tokens == 60 - len(a.response_ids[: a.turn_ends[0] + 1]) - len(
        ids("\n<interpreter>\nout:1\n</interpreter>\n"))
    assert len(a.response_ids) == len(b.response_ids) == 60 and a.end == b.end == "length"


def test_routed_experts_of_every_position_come_from_the_call_that_forwarded_it():
    """Routing replay through tool turns (megarl.rollout.multi_turn.stitch_routing): each position
    keeps the experts of the first call that forwarded it: the prompt and a turn's tokens that of
    their call, a turn's last token and the observation after it the next call's; a turn cut to
    the budget is cut in the experts too."""
    from tests.unit.scripted_engine import first_forwards

    engine = ScriptedEngine([["a<code>1</code>", "Answer: 5"], ["b<code>2</code>"], ["x" * 40]], routing=(3, 2))
    t0, t1 = tool_rollout(engine, [ids("P")], SamplingParams(n=2, max_new_tokens=40), CodeFormat(), EchoTools(),
                          max_turns=4, encode=ids, decode=decode, budget=130)
    total = 1 + len(t0.response_ids)
    ends = [1 + e + 1 for e in t0.turn_ends]  # the sequence each of t0's calls ended with
    assert t0.turns == 3 and t0.end == "length" and len(t0.response_ids) == 130  # the third turn cut to the budget
    assert t0.routed_experts.shape == (total, 3, 2)
    assert t0.routed_experts[:, 0, 0].tolist() == first_forwards(ends, total)
    assert t0.routed_experts[:, 2, 1].tolist() == first_forwards(ends, total)  # every layer and slot alike
    assert set(t0.routed_experts[:, 0, 0].tolist()) == {0, 1, 2, -1}
    assert t1.routed_experts[:, 0, 0].tolist() == [0] * len(t1.response_ids) + [-1]
    # without routing the trajectories carry none
    (t,) = tool_rollout(ScriptedEngine([["Answer: 1"]]), [[1]], SamplingParams(n=1, max_new_tokens=40),
                        CodeFormat(), EchoTools(), max_turns=2, encode=ids, decode=decode)
    assert t.routed_experts is None


def test_chat_json_calls_run_together_and_come_back_in_the_template():
    tok = byte_tokenizer_with(QWEN2_5)
    call = lambda c: '<tool_call>\n' + json.dumps({"name": "python", "arguments": {"code": c}}) + '\n</tool_call>'  # noqa: E731
    engine = ScriptedEngine([[call("a") + "\n" + call("b") + "<|im_end|>"], ["Answer: 2<|im_end|>"]])
    (t,) = tool_rollout(engine, [[1]], SamplingParams(n=1, max_new_tokens=600), ChatJsonFormat(tok), EchoTools(),
                        max_turns=3, encode=ids, decode=decode)
    assert [r.text for _, r in t.calls] == ["out:a", "out:b"] and t.call_turns == [0, 0]
    obs = decode([x for x, m in zip(t.response_ids, t.obs_mask) if m])
    assert obs == ("\n<|im_start|>user\n<tool_response>\nout:a\n</tool_response>\n<tool_response>\nout:b\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert engine.calls[0][1].stop == []  # the turn ends on EOS, like any chat turn


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_turns"):
        tool_rollout(ScriptedEngine([]), [[1]], SamplingParams(), CodeFormat(), EchoTools(), 0, ids, decode)
    with pytest.raises(ValueError, match="3 results for 1 calls"):
        tool_rollout(ScriptedEngine([["<code>1</code>"]]), [[1]], SamplingParams(), CodeFormat(),
                     lambda reqs: [ToolResult("python", "")] * 3, 2, ids, decode)
    with pytest.raises(ValueError, match="chat template"):
        ChatJsonFormat(type("T", (), {"chat_template": None})())
    assert ToolCall("x").arguments == {}
