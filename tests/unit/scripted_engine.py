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
    cut to it (finish "length"), as an engine would; false keeps every text whole. routing=(layers,
    k): every sample carries routed_experts [context + response, layers, k] whose entries are the
    call's index at the positions that call forwards (all but the sequence's last) and -1 at the
    last, so a test can tell which call's experts each position kept."""

    def __init__(self, script: list[list[str]], max_context: int | None = None, truncate: bool = True,
                 routing: tuple[int, int] | None = None):
        self.script, self.calls, self.truncate, self.routing = script, [], truncate, routing
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
                                  ids(text)) > len(tok) else "stop", index=j // sampling.n,
                              routed_experts=self._routed(len(prompts[j // sampling.n]) + len(tok), k)))
        return out

    def _routed(self, n: int, call: int):
        if self.routing is None:
            return None
        import torch

        out = torch.full((n, *self.routing), call, dtype=torch.int16)
        out[-1] = -1
        return out


def first_forwards(call_lengths: list[int], total: int) -> list[int]:
    """The call that first forwarded each of a multi-turn sequence's `total` positions, when call c
    ended with a sequence of call_lengths[c] tokens (it forwards all but the last); -1: never."""
    return [next((c for c, n in enumerate(call_lengths) if p < n - 1), -1) for p in range(total)]
