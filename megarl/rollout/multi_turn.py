"""PAG multi-turn rollouts (docs/algorithms.md §8): solution, self-verification, selective revision,
all in ONE trajectory, through the RolloutEngine `generate` interface only (builtin or SGLang).

For every prompt `sampling.n` trajectories:

    prompt | y_1 | V | v_1 | R | y_2 | V | v_2 | ... | y_Tmax

y_t: policy (solution) turns, v_t: verifier turns, V / R: the verify / revise instructions as
template tokens (appended, never sampled: log-prob 0, `template_mask` 1, no loss, no value).
After y_t (t < T_max) the verify instruction and a verification follow; a revision follows only
when that verification's verdict is "The answer is wrong" (`parse_verdict`), and the trajectory
stops on "correct", on a missing / duplicated verdict, after T_max policy turns (no verification
of the last one, as the released code) or when the next turn would not fit the engine's context
(`engine.max_context`, where the engine has one; the trajectory then ends with "length").

A later turn is a new `generate` call on prompt + everything so far + the instruction (n = 1):
all first turns in one call, then all verifications of the round in one call, then all
revisions in one call. The seed of the k-th call is sampling.seed + 7919 * k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megarl.rollout.types import SamplingParams

VERDICT_CORRECT = "The answer is correct"
VERDICT_WRONG = "The answer is wrong"
VERDICT_MISSING = -1
_SEED_STRIDE = 7919


def stitch_routing(prev: torch.Tensor | None, new: torch.Tensor | None, total: int,
                   first: bool) -> torch.Tensor | None:
    """Routed experts [total, layers, k] of a multi-turn sequence after one more turn (routing replay).

    `new` covers the turn's call: the context (prompt + everything so far + any appended tokens)
    and the tokens it generated; `prev` the sequence the previous call ended with. A token keeps the
    experts of the call that first forwarded it: every earlier token but the last from `prev`, the
    rest (the previous turn's last token, forwarded first by this call's prefill, the appended
    tokens, this turn's tokens) from `new`, cut to `total` tokens. None when a call recorded none.
    """
    if new is None or (prev is None and not first):
        return None
    if first:
        return new[:total]
    n = prev.shape[0]
    if new.shape[0] < total:
        raise ValueError(f"routed experts of a turn cover {new.shape[0]} tokens, the sequence has {total}")
    return torch.cat([prev[: n - 1], new[n - 1: total]])


def parse_verdict(text: str) -> int:
    """1 when the text holds exactly one verdict phrase and it is "The answer is correct", 0 when
    it is "The answer is wrong", -1 (VERDICT_MISSING) when it holds none or more than one
    (missing or duplicated verdict)."""
    n_correct, n_wrong = text.count(VERDICT_CORRECT), text.count(VERDICT_WRONG)
    if n_correct + n_wrong != 1:
        return VERDICT_MISSING
    return 1 if n_correct else 0


@dataclass
class MultiTurnSample:
    """One multi-turn trajectory. response_ids / logprobs / template_mask are aligned (every turn and
    instruction, in order); turn k spans response indices turn_ends[k-1]+1 .. turn_ends[k] (its
    instruction tokens first). turn_texts: each turn's generated text; verdicts: parse_verdict of
    each verifier turn, None on policy turns."""

    prompt_ids: list[int]
    index: int  # which prompt of the request list
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    template_mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_is_policy: list[bool] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    verdicts: list[int | None] = field(default_factory=list)
    finish_reason: str = "stop"  # of the last turn; "length" also when the context ran out
    routed_experts: torch.Tensor | None = None  # MoE: [prompt + response, layers, k] (stitch_routing)

    @property
    def policy_turns(self) -> int:
        return sum(self.turn_is_policy)

    def context_len(self, template: list[int]) -> int:
        """Tokens of the context the next turn after `template` is generated from."""
        return len(self.prompt_ids) + len(self.response_ids) + len(template)

    def add_turn(self, template: list[int], ids: list[int], logprobs: list[float], is_policy: bool,
                 text: str, finish_reason: str, routed: torch.Tensor | None = None) -> None:
        if not ids:
            raise ValueError("multi-turn rollout: the engine returned an empty turn")
        total = len(self.prompt_ids) + len(self.response_ids) + len(template) + len(ids)
        self.routed_experts = stitch_routing(self.routed_experts, routed, total, first=not self.turn_ends)
        self.response_ids += list(template) + list(ids)
        self.logprobs += [0.0] * len(template) + [float(x) for x in logprobs]
        self.template_mask += [1] * len(template) + [0] * len(ids)
        self.turn_ends.append(len(self.response_ids) - 1)
        self.turn_is_policy.append(is_policy)
        self.turn_texts.append(text)
        self.verdicts.append(None if is_policy else parse_verdict(text))
        self.finish_reason = finish_reason


def pag_rollout(engine, prompts: list[list[int]], sampling: SamplingParams, verify_ids: list[int],
                revise_ids: list[int], max_policy_turns: int, decode: Callable[[list[int]], str]) -> list[MultiTurnSample]:
    """`sampling.n` PAG trajectories per prompt, prompt-major (module docstring). `decode` turns a
    turn's token ids into text (for the verdict) when the engine's Sample.text is empty."""
    if max_policy_turns < 1:
        raise ValueError(f"pag_rollout: max_policy_turns must be >= 1, got {max_policy_turns}")
    calls = 0

    def run(contexts: list[list[int]], params: SamplingParams):
        nonlocal calls
        seed = None if sampling.seed is None else sampling.seed + _SEED_STRIDE * calls
        calls += 1
        return engine.generate(contexts, SamplingParams(**{**params.__dict__, "seed": seed}))

    trajs = []
    for s in run(prompts, sampling):
        t = MultiTurnSample(prompt_ids=list(s.prompt_ids), index=s.index)
        t.add_turn([], s.response_ids, s.logprobs, True, s.text or decode(s.response_ids), s.finish_reason,
                   s.routed_experts)
        trajs.append(t)
    one = SamplingParams(**{**sampling.__dict__, "n": 1})
    limit = getattr(engine, "max_context", None)

    def extend(active: list[int], template: list[int], is_policy: bool) -> list[int]:
        """Appends `template` and a generated turn to trajs[i] for i in active; those whose context
        would leave no room end with "length". Returns the indices that got a turn."""
        fits = []
        for i in active:
            if limit is not None and trajs[i].context_len(template) >= limit:
                trajs[i].finish_reason = "length"
            else:
                fits.append(i)
        if fits:
            out = run([trajs[i].prompt_ids + trajs[i].response_ids + list(template) for i in fits], one)
            for i, s in zip(fits, out):
                trajs[i].add_turn(template, s.response_ids, s.logprobs, is_policy, s.text or decode(s.response_ids),
                                  s.finish_reason, s.routed_experts)
        return fits

    active = [i for i, t in enumerate(trajs) if t.policy_turns < max_policy_turns]
    while active:
        verified = extend(active, verify_ids, is_policy=False)
        wrong = [i for i in verified if trajs[i].verdicts[-1] == 0]
        revised = extend(wrong, revise_ids, is_policy=True)
        active = [i for i in revised if trajs[i].policy_turns < max_policy_turns]
    return trajs
