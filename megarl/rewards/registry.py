"""Registry of reward functions by name.

A factory `(params: dict, resources: dict) -> BuiltReward` validates its params and returns
either a per-sample function (run in the manager's thread pool) or a batch function (called
once per score() call with all samples of its route, e.g. a GenRM that batches judge prompts).
A batch function returns one RewardOutput or Exception per input.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from megarl.registry import Registry, import_object, is_dotted_path
from megarl.rewards.types import RewardError, RewardInput, RewardOutput

SampleFn = Callable[[RewardInput], RewardOutput]
BatchFn = Callable[[list[RewardInput]], list[RewardOutput | Exception]]


@dataclass
class BuiltReward:
    failure_score: float  # the function's default; a spec or the config may override it
    sample_fn: SampleFn | None = None
    batch_fn: BatchFn | None = None


Factory = Callable[[dict, dict], BuiltReward]
REWARDS = Registry("reward function")


def register_reward(name: str) -> Callable[[Factory], Factory]:
    return REWARDS.register(name)


def build_reward(name: str, params: dict, resources: dict) -> BuiltReward:
    """A registered reward by name, or user code by dotted path ('package.module:function')."""
    if is_dotted_path(name):
        return _custom(import_object(name, f"reward function {name!r}"), dict(params))
    if name not in REWARDS:
        raise ValueError(f"unknown reward function {name!r} (registered: {sorted(REWARDS)}; "
                         "or give 'package.module:function')")
    return REWARDS[name](dict(params), resources)


def _custom(fn: Callable, params: dict) -> BuiltReward:
    """A user function `fn(x: RewardInput, **params) -> RewardOutput | float` (a float is the
    score, correct when > 0); it fails with 0 (the manager scores crashes and timeouts so)."""

    def sample_fn(x: RewardInput) -> RewardOutput:
        out = fn(x, **params)
        if isinstance(out, RewardOutput):
            return out
        if isinstance(out, (int, float)) and not isinstance(out, bool):
            return RewardOutput(float(out), float(out) > 0)
        raise RewardError(f"custom reward returned {type(out).__name__}; expected RewardOutput or a float")

    return BuiltReward(failure_score=0.0, sample_fn=sample_fn)


def make_params(cls: type, params: dict, where: str):
    """cls(**params) with an error naming the unknown / invalid field."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} (known: {sorted(known)})")
    return cls(**params)


# ------------------------------------------------------------------------ builtin rewards

@register_reward("math")
def _math(params: dict, resources: dict) -> BuiltReward:
    from megarl.rewards.math import MathRewardParams, math_reward

    p = make_params(MathRewardParams, params, "reward 'math' params")
    pool = resources.get("math_pool")
    return BuiltReward(failure_score=p.incorrect_score,
                       sample_fn=lambda x: math_reward(x.response, x.gold, p, pool=pool))


@register_reward("code")
def _code(params: dict, resources: dict) -> BuiltReward:
    from megarl.rewards.code import CodeRewardParams, code_reward, parse_tests

    p = make_params(CodeRewardParams, params, "reward 'code' params")
    return BuiltReward(failure_score=p.incorrect_score,
                       sample_fn=lambda x: code_reward(x.response, parse_tests(x.extra, x.gold), p))


def _judge(params: dict, resources: dict, name: str):
    key = params.pop("judge", "judge")
    if key not in resources:
        raise ValueError(f"reward {name!r}: no judge resource {key!r} was given to RewardManager "
                         f"(resources: {sorted(resources)})")
    if params:
        raise ValueError(f"reward {name!r}: unknown field(s) {sorted(params)} (known: ['judge'])")
    return resources[key]


def _genrm_batch(judge, require_anchor: bool, centre: float = 0.0) -> BatchFn:
    def run(batch: list[RewardInput]) -> list[RewardOutput | Exception]:
        out: list[RewardOutput | Exception | None] = [None] * len(batch)
        pair_idx, pair_items, point_idx, point_items = [], [], [], []
        for i, x in enumerate(batch):
            anchor = x.reference if x.reference is not None else x.gold
            if anchor is not None:  # the gold answer is shown to the judge beside a reference
                pair_idx.append(i)
                pair_items.append((x.prompt, x.response, anchor,
                                   x.gold if x.reference is not None else None))
            elif require_anchor:
                out[i] = RewardError("pairwise GenRM needs an anchor (reference or gold)")
            else:
                point_idx.append(i)
                point_items.append((x.prompt, x.response, None))
        judged = [(i, r, "pairwise") for i, r in zip(pair_idx, judge.pairwise(pair_items))] \
            if pair_items else []
        judged += [(i, r, "pointwise") for i, r in zip(point_idx, judge.pointwise(point_items))] \
            if point_items else []
        for i, res, kind in judged:
            out[i] = (RewardError(f"GenRM ({kind}): the judge gave no valid verdict") if res is None
                      else RewardOutput(res.score - centre, res.score > 0.5,
                                        {"kind": kind, "probs": res.probs, "win_prob": res.score}))
        return out
    return run


@register_reward("genrm")
def _genrm(params: dict, resources: dict) -> BuiltReward:
    """Pairwise against the reference (or gold) when the sample has one, else pointwise."""
    judge = _judge(params, resources, "genrm")
    return BuiltReward(failure_score=0.5, batch_fn=_genrm_batch(judge, require_anchor=False))


@register_reward("pairwise_genrm")
def _pairwise_genrm(params: dict, resources: dict) -> BuiltReward:
    """Pairwise-RL: win probability r against the anchor, both orders (docs/algorithms.md §6), minus
    `centre` (param, default 0.0 = raw r in [0, 1]). [NS→C] the labelled common choice for pairwise
    PPO is the terminal reward r − 0.5 (centre: 0.5; configs/algorithms/pairwise_rl.yaml), which the
    trainer places on the last response token before GAE: parity with the anchor scores 0, and
    so does a failed judgement (failure score 0.5 − centre). `acc` is r > 0.5 either way."""
    centre = params.pop("centre", 0.0)
    if isinstance(centre, bool) or not isinstance(centre, (int, float)) or not 0.0 <= centre <= 1.0:
        raise ValueError(f"reward 'pairwise_genrm' params.centre must be a number in [0, 1], got {centre!r}")
    judge = _judge(params, resources, "pairwise_genrm")
    return BuiltReward(failure_score=0.5 - centre, batch_fn=_genrm_batch(judge, require_anchor=True, centre=centre))
