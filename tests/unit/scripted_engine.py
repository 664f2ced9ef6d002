"""A scripted rollout engine for the multi-turn rollout tests (PAG, tool calls): the RolloutEngine
generate interface with fixed turn texts, one character a token."""

from __future__ import annotations

from megarl.rollout import Sample


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(tokens: list[int]) -> str:
    return "".join(chr(t) for t in tokens)


class ScriptedEngine:
    """generate() answers call k with script[k][j] for its j-th context (text -> char tokens,
    log-probs -0.1, -0.2, ...; a text ending in '~' is cut there: finish "length"); records
    every call's contexts and sampling. truncate: a text longer than the call's max_new_tokens is
    cut to it (finish "length"), as an engine would; false keeps every text whole."""

    def __init__(self, script: list[list[str]], max_context: int | None = None, truncate: bool = True):
        self.script, self.calls, self.truncate = script, [], truncate
        if max_context is not None:
            self.max_context = max_context

    def generate(self, prompts, sampling):
        k = len(self.calls)
        self.calls.append(([list(p) for p in prompts], sampling))
        texts = self.script[k]
        assert len(texts) == len(prompts) * sampling.n, f"call {k}: {len(prompts)} contexts x n={sampling.n}"
        out = []
        for j, text in enumerate(texts):
            cut = text.endswith("~")
            tok = ids(text.rstrip("~"))[: sampling.max_new_tokens if self.truncate else None]
            out.append(Sample(prompt_ids=list(prompts[j // sampling.n]), response_ids=tok,
                              logprobs=[-0.1 * (i + 1) for i in range(len(tok))],
                              finish_reason="length" if cut or len(tok) == sampling.max_new_tokens and len(
                                  ids(text)) > len(tok) else "stop", index=j // sampling.n))
        return out
