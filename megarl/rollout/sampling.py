"""Next-token sampling on logits: temperature, top-k, top-p, greedy, FIRE first-token params.

Pure functions of tensors; the builtin engine calls them once per decode step, the SGLang request
builder uses `token_samplers` for the same FIRE rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megarl.rollout.types import SamplingParams


@dataclass(frozen=True)
class TokenSampler:
    """How one token is drawn: temperature 0 = greedy; top_k <= 0 and top_p >= 1 are off."""

    temperature: float
    top_k: int
    top_p: float


def token_samplers(sampling: SamplingParams) -> tuple[TokenSampler, TokenSampler]:
    """(first-token sampler, sampler for every later token).

    FIRE (docs/algorithms.md §9): the first token uses temperature `fire_temperature` and top-k
    `top_k` if the configured top_k > 0, else `fire_top_k`; top_p stays the regular one. The FIRE
    fields are written last, on a copy of the regular sampler, so no regular setting can overwrite
    them (the later-verl pitfall).
    """
    regular = TokenSampler(sampling.temperature, sampling.top_k, sampling.top_p)
    if not sampling.fire:
        return regular, regular
    fire_top_k = sampling.top_k if sampling.top_k > 0 else sampling.fire_top_k
    return replace(regular, temperature=sampling.fire_temperature, top_k=fire_top_k), regular


def filtered_logprobs(logits: torch.Tensor, sampler: TokenSampler) -> torch.Tensor:
    """Log-probabilities [B, V] of the distribution a token is sampled from.

    p = softmax(logits / T), restricted to the top_k largest entries, then to the smallest
    prefix of the descending-sorted probabilities whose mass reaches top_p (a token is kept iff
    the mass strictly before it is < top_p), then renormalised. Removed tokens get -inf.
    Greedy (T = 0) returns the unmodified log_softmax(logits), i.e. temperature 1.
    """
    logits = logits.float()
    if sampler.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampler.temperature
    vocab = logits.shape[-1]
    if 0 < sampler.top_k < vocab:
        keep = torch.topk(logits, sampler.top_k, dim=-1).indices
        masked = torch.full_like(logits, float("-inf"))
        logits = masked.scatter(-1, keep, logits.gather(-1, keep))
    if sampler.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampler.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logits: torch.Tensor, sampler: TokenSampler,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row of `logits` [B, V].

    Returns (token ids [B] int64, log-probability [B] fp32 of each token under the distribution
    it was drawn from, see `filtered_logprobs`). Greedy picks argmax(logits).
    """
    logprobs = filtered_logprobs(logits, sampler)
    if sampler.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def segment_budget(context_len: int, done: int, sampling: SamplingParams,
                   max_context: int) -> tuple[int, bool]:
    """New tokens allowed in this generate/continue segment, and whether the window set it.

    budget = min(max_new_tokens - done, max_context - context_len, window). When the window is
    strictly the smallest bound, reaching the budget means "truncated" (T-PPO, may continue);
    otherwise it means "length". `done` is the response length produced by earlier segments.
    """
    limit = min(sampling.max_new_tokens - done, max_context - context_len)
    if sampling.window is not None and sampling.window < limit:
        return sampling.window, True
    return limit, False
