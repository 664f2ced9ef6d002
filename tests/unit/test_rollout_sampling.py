"""Sampling correctness: temperature / top-k / top-p / FIRE / seeds / stop conditions.

A "controlled" model has all attention and MLP weights zero, all-ones embeddings, RMSNorm
eps 0 and lm_head column 0 = LOGITS, so its next-token logits are exactly LOGITS at every
position. Expected distributions are computed here by hand (`expected_probs`), independently of
megarl.rollout.sampling.
"""

from __future__ import annotations

import math
import string
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from megarl.rollout import BuiltinEngine, SamplingParams
from megarl.rollout.sampling import (
    TokenSampler, filtered_logprobs, sample_tokens, segment_budget, token_samplers)

LOGITS = [2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.2, 0.0, -0.3, -0.6, -1.0, -1.4, -1.9, -2.5, -3.0, -3.6]
DRAWS = 4000


def expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T) -> keep top_k -> keep the smallest prefix with mass >= top_p."""
    z = [x / temperature for x in logits]
    m = max(z)
    weights = [math.exp(x - m) for x in z]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k > 0 else order
    total = sum(weights[i] for i in keep)
    probs = {i: weights[i] / total for i in keep}
    if top_p < 1:
        kept, mass = [], 0.0
        for i in keep:
            if mass < top_p:
                kept.append(i)
                mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(len(logits))]


def controlled_engine(logits: list[float] = LOGITS) -> BuiltinEngine:
    vocab, hidden = len(logits), 8
    config = dict(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, rms_norm_eps=0.0)
    engine = BuiltinEngine(config, eos_token_ids=[])
    state = {name: torch.zeros(p.shape) for name, p in engine.model.named_parameters()}
    for name in state:
        if name.endswith("norm.weight"):
            state[name] = torch.ones(hidden)
    state["model.embed_tokens.weight"] = torch.ones(vocab, hidden)
    state["lm_head.weight"][:, 0] = torch.tensor(logits)
    engine.update_weights([list(state.items())])
    return engine


def assert_frequencies(tokens: list[int], probs: list[float]) -> None:
    """Filtered tokens never drawn; chi-square over kept tokens within a generous bound."""
    counts = Counter(tokens)
    kept = [i for i, p in enumerate(probs) if p > 0]
    assert set(counts) <= set(kept), f"drew filtered tokens {set(counts) - set(kept)}"
    n = len(tokens)
    chi2 = sum((counts.get(i, 0) - n * probs[i]) ** 2 / (n * probs[i]) for i in kept)
    dof = max(len(kept) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2={chi2:.1f} dof={dof}"


def test_filtered_logprobs_match_hand_computed():
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    for t, k, p in [(1.0, -1, 1.0), (0.5, -1, 1.0), (2.0, 3, 1.0), (1.0, -1, 0.7), (0.7, 6, 0.8),
                    (1.0, 1, 1.0), (1.3, 100, 0.999)]:
        got = filtered_logprobs(logits, TokenSampler(t, k, p)).exp()
        torch.testing.assert_close(got[0], torch.tensor(expected_probs(LOGITS, t, k, p)),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], torch.tensor(expected_probs(LOGITS[::-1], t, k, p)),
                                   atol=1e-6, rtol=0)
    greedy = filtered_logprobs(logits, TokenSampler(0.0, 3, 0.5))  # greedy: plain log-softmax
    torch.testing.assert_close(greedy, logits.log_softmax(-1))
    tokens, logprobs = sample_tokens(logits, TokenSampler(0.0, -1, 1.0), None)
    assert tokens.tolist() == [0, len(LOGITS) - 1]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, -1, 1.0), (0.6, -1, 1.0), (2.5, -1, 1.0), (1.0, 4, 1.0), (1.0, -1, 0.6), (0.8, 7, 0.9)])
def test_sampled_frequencies_and_logprobs(temperature, top_k, top_p):
    engine = controlled_engine()
    sp = SamplingParams(n=DRAWS, temperature=temperature, top_k=top_k, top_p=top_p,
                        max_new_tokens=1, seed=11)
    samples = engine.generate([[3]], sp)
    probs = expected_probs(LOGITS, temperature, top_k, top_p)
    assert_frequencies([s.response_ids[0] for s in samples], probs)
    for s in samples[:50]:
        assert s.logprobs[0] == pytest.approx(math.log(probs[s.response_ids[0]]), abs=1e-5)
        assert s.finish_reason == "length"


def test_seed_is_reproducible_and_independent_of_global_rng():
    engine = controlled_engine()
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=42)
    torch.manual_seed(1)
    a = [s.response_ids for s in engine.generate([[1], [2]], sp)]
    torch.manual_seed(2)
    b = [s.response_ids for s in engine.generate([[1], [2]], sp)]
    assert a == b
    global_state = torch.get_rng_state()
    engine.generate([[1]], SamplingParams(n=4, max_new_tokens=3))  # seed=None: fresh entropy
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG is not consumed
    c = [s.response_ids for s in engine.generate([[1], [2]], SamplingParams(
        n=8, temperature=1.0, max_new_tokens=6, seed=43))]
    assert c != a


def test_fire_changes_only_the_first_token_distribution():
    engine = controlled_engine()
    sp = SamplingParams(n=DRAWS, temperature=0.7, max_new_tokens=2, fire=True,
                        fire_temperature=30.0, fire_top_k=4, seed=3)
    samples = engine.generate([[5]], sp)
    fire = expected_probs(LOGITS, 30.0, 4, 1.0)
    regular = expected_probs(LOGITS, 0.7, -1, 1.0)
    assert_frequencies([s.response_ids[0] for s in samples], fire)
    assert_frequencies([s.response_ids[1] for s in samples], regular)
    for s in samples[:50]:
        assert s.logprobs[0] == pytest.approx(math.log(fire[s.response_ids[0]]), abs=1e-5)
        assert s.logprobs[1] == pytest.approx(math.log(regular[s.response_ids[1]]), abs=1e-5)
    # a configured top_k > 0 replaces fire_top_k; FIRE's temperature is never overwritten
    first, rest = token_samplers(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, fire=True))
    assert first == TokenSampler(30.0, 3, 0.9) and rest == TokenSampler(0.7, 3, 0.9)
    first, rest = token_samplers(SamplingParams(temperature=0.0, fire=True, fire_top_k=16))
    assert first == TokenSampler(30.0, 16, 1.0) and rest == TokenSampler(0.0, -1, 1.0)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """Random Qwen2 model with a 65-token character tokenizer (id i <-> one character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + " ."
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": len(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    path = tmp_path_factory.mktemp("char_model")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.1, eos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_stop_strings_and_stop_token_ids(char_model):
    engine = BuiltinEngine.from_pretrained(char_model)
    assert engine.tokenizer is not None and engine.eos_token_ids == [64]  # the tokenizer's EOS
    engine.eos_token_ids = []  # long free-running texts to cut with stop conditions
    prompts = [[1, 2, 3], [40, 41], [7, 8, 9, 10]]
    for k, prompt in enumerate(prompts):
        s = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=24, seed=9))[0]
        assert s.text == engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        ids = s.response_ids
        stop = s.text[5:7]  # spans two tokens
        cut = next(j for j in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:j]))
        out = engine.generate([prompts[k]], SamplingParams(temperature=1.0, max_new_tokens=24,
                                                           seed=9, stop=[stop, "@@"]))[0]
        # same seed and a single row: the same draws until the stop string completes
        assert out.response_ids == ids[:cut] and out.finish_reason == "stop"
        assert out.text.endswith(stop)
        stop_id = ids[4]
        out = engine.generate([prompts[k]], SamplingParams(temperature=1.0, max_new_tokens=24,
                                                           seed=9, stop_token_ids=[stop_id]))[0]
        assert out.response_ids == ids[:ids.index(stop_id) + 1] and out.finish_reason == "stop"


def test_fire_rest_equals_regular_generation_from_same_prefix(char_model):
    """With greedy regular sampling, tokens 2.. of a FIRE sample are the greedy continuation of
    prompt + first token, with identical log-probs."""
    engine = BuiltinEngine.from_pretrained(char_model)
    prompt = [3, 1, 4, 1, 5]
    fire = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, n=6,
                                                    fire=True, seed=2))
    assert len({s.response_ids[0] for s in fire}) > 1  # the first token is really sampled
    for s in fire:
        rest = engine.generate([prompt + s.response_ids[:1]],
                               SamplingParams(temperature=0, max_new_tokens=9))[0]
        assert s.response_ids[1:] == rest.response_ids
        torch.testing.assert_close(torch.tensor(s.logprobs[1:]), torch.tensor(rest.logprobs),
                                   atol=1e-5, rtol=0)


def test_segment_budget():
    sp = SamplingParams(max_new_tokens=10, window=4)
    assert segment_budget(5, 0, sp, 100) == (4, True)
    assert segment_budget(5, 8, sp, 100) == (2, False)  # the total bound comes first
    assert segment_budget(5, 6, sp, 100) == (4, False)  # window == remaining: "length"
    assert segment_budget(97, 0, sp, 100) == (3, False)  # context room
    assert segment_budget(5, 0, SamplingParams(max_new_tokens=10), 100) == (10, False)
