"""Tool-calling rollouts through the SGLang engine build their multi-turn requests through the same
code as through the builtin engine (megarl/rollout/tool_loop.py only calls `generate`).

SGLang cannot run here: as in test_rollout_sglang.py, a stand-in for `sglang.Engine` reads the
requests the way SGLang does (input_ids, one sampling-params dict per request, stop strings),
generates with the builtin engine on the same checkpoint and answers in SGLang's output format.
The loop runs on the builtin engine directly and through `SGLangEngine(stand-in)`: same
trajectories, and every request SGLang received is a context of the builtin run (prompt +
everything so far) with the format's stop string. The SGLang path itself is verified only on GPU
(README, docs/verified.md)."""

from __future__ import annotations

import types

import pytest

from megarl.rollout import BuiltinEngine, SamplingParams
from megarl.rollout.sglang.engine import SGLangEngine
from megarl.rollout.tool_calls import ToolCall, ToolResult
from megarl.rollout.tool_loop import tool_rollout


class StandIn:
    """`sglang.Engine` stand-in (module docstring); records every request."""

    def __init__(self, **kwargs):
        self.kwargs, self.requests = kwargs, []
        self.backend = BuiltinEngine.from_pretrained(kwargs["model_path"])

    def release_memory_occupation(self, tags=None):
        pass

    def resume_memory_occupation(self, tags=None):
        pass

    def generate(self, input_ids, sampling_params, return_logprob, **_):
        outs = []
        for ids, d in zip(input_ids, sampling_params):
            self.requests.append((list(ids), dict(d)))
            sp = SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                max_new_tokens=d["max_new_tokens"], stop=d.get("stop", []), seed=d.get("sampling_seed"))
            s = self.backend.generate([ids], sp)[0]
            finish = ({"type": "stop", "matched": s.response_ids[-1]} if s.finish_reason == "stop"
                      else {"type": "length", "length": len(s.response_ids)})
            outs.append({"output_ids": s.response_ids, "meta_info": {"finish_reason": finish, "output_token_logprobs": [
                (lp, t, None) for lp, t in zip(s.logprobs, s.response_ids)]}})
        return outs


class MarkFormat:
    """A test format: a turn that ends with `mark` (its stop string) calls the tool with its text;
    the observation is ``[<result>]``. (A random tiny model writes no <code> blocks.)"""

    name = "mark"

    def __init__(self, mark: str):
        self.mark, self.stop = mark, [mark]

    def parse(self, text):
        return [ToolCall("python", {"code": text})] if text.endswith(self.mark) else []

    def observation(self, results, turn_text=""):
        return "[" + ",".join(r.text for r in results) + "]"


def lengths(requests):
    return [ToolResult("python", str(len(r.call.arguments["code"]))) for r in requests]


@pytest.fixture()
def checkpoint(tmp_path):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    return save_tiny_model(tmp_path / "m", TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                                         initializer_range=0.5, seed=3))


def test_sglang_and_builtin_engines_take_the_same_turns(checkpoint):
    builtin = BuiltinEngine.from_pretrained(checkpoint)
    tok = builtin.tokenizer
    prompts = [tok.encode("Q: 12*34=?\n"), tok.encode("Q: 7*8=?\n")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    first = builtin.generate(prompts[:1], greedy)[0].text
    mark = next(c for c in first[2:] if c.strip())  # a character the greedy model writes early: turns end there
    common = dict(fmt=MarkFormat(mark), execute=lengths, max_turns=4, budget=60,
                  encode=lambda s: tok.encode(s, add_special_tokens=False),
                  decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    want = tool_rollout(builtin, prompts, greedy, **common)
    assert any(t.turns > 1 for t in want), "the scripted mark never ended a turn: no multi-turn trajectory"

    sglang = types.SimpleNamespace(Engine=StandIn, __version__="0.5.23")
    engine = SGLangEngine(checkpoint, base_gpu_id=0, sglang_module=sglang, start=True)
    got = tool_rollout(engine, prompts, greedy, **common)
    assert [(t.response_ids, t.obs_mask, t.turn_ends, t.end) for t in got] == \
        [(t.response_ids, t.obs_mask, t.turn_ends, t.end) for t in want]
    assert all(g.logprobs == pytest.approx(w.logprobs, abs=1e-5) for g, w in zip(got, want))
    requests = engine._engine.requests
    # every request was a whole context of the builtin run: the prompt, then the turns and observations
    # before a turn (a turn starts where an observation ends), with the format's stop string
    contexts = sorted(p + t.response_ids[:start] for p, t in zip(prompts, want)
                      for start in [0] + [i for i in range(1, len(t.obs_mask)) if t.obs_mask[i - 1] and not t.obs_mask[i]])
    assert sorted(ids for ids, _ in requests) == contexts
    assert all(params["stop"] == [mark] for _, params in requests)
