"""GenRM: prompt rendering, verdict parsing, the pairwise formula (docs/algorithms.md §6/§7), and a
judge served by the builtin engine over a tiny random Qwen2 with an offline tokenizer."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from megarl.rewards import RewardConfig, RewardInput, RewardManager
from megarl.rewards.genrm import (
    DEFAULT_PAIRWISE_TEMPLATE, DEFAULT_POINTWISE_TEMPLATE, GOLD_BLOCK, GenerativeJudge,
    HFNextTokenScorer, JudgeConfig, pairwise_score, parse_first_label, parse_verdict, render,
    two_label_prob)
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams

QUESTION, POLICY, ANCHOR = "what is two plus two ?", "four", "it is 4"


# ----------------------------------------------------------------------------- pure logic

def test_render_keeps_braces_in_values():
    out = render("Q: {prompt}\nA: {response} {unknown}", prompt="f(x) = {x}", response="{a}")
    assert out == "Q: f(x) = {x}\nA: {a} {unknown}"


def test_judge_config_validation():
    with pytest.raises(ValueError, match="placeholders"):
        JudgeConfig(pairwise_template="{prompt} {response_a}")
    with pytest.raises(ValueError, match="mode"):
        JudgeConfig(mode="vote")


@pytest.mark.parametrize("text, expected", [(" A]]", 0), ("B]] because", 1), ("Apple", None),
                                            ("  C", None), ("", None)])
def test_parse_first_label(text, expected):
    assert parse_first_label(text, ("A", "B")) == expected


def test_parse_verdict_takes_the_last_one():
    text = 'I could say "Verdict: [[A]]" but no.\nVerdict: [[B]]'
    assert parse_verdict(text, ("A", "B"), "Verdict: [[") == 1
    assert parse_verdict("Verdict : [[ Yes ]]", ("Yes", "No"), "Verdict : [[") == 0
    assert parse_verdict("no verdict", ("A", "B"), "Verdict: [[") is None


def test_pairwise_formula():
    # r = ½·(P(policy ≻ anchor | policy first) + 1 − P(anchor ≻ policy | anchor first))
    assert pairwise_score(0.8, 0.3) == pytest.approx(0.75)
    assert pairwise_score(1.0, 1.0) == 0.5     # always prefers position 1: parity
    assert pairwise_score(0.0, 0.0) == 0.5     # always prefers position 2: parity
    assert pairwise_score(1.0, 0.0) == 1.0 and pairwise_score(0.0, 1.0) == 0.0
    assert two_label_prob(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert two_label_prob(-1000.0, 0.0) == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- tiny judge

def _tokenizer() -> PreTrainedTokenizerFast:
    words = set()
    for text in (DEFAULT_PAIRWISE_TEMPLATE, DEFAULT_POINTWISE_TEMPLATE, GOLD_BLOCK,
                 f"Verdict: [[ A B Yes No ]] {QUESTION} {POLICY} {ANCHOR}"):
        words |= set(re.findall(r"\w+|[^\w\s]+", text))
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="[EOS]")


def _model(vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, eos_token_id=2,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _bigram(model, tok, chain: dict[str, str]):
    """Weight surgery: zero every block's output so the last hidden state depends only on the
    last token, then make lm_head map token t to chain[t] (logit 10·|h|² = 320 vs ~±30)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token, nxt in chain.items():
            embedding = model.model.embed_tokens.weight[tok.convert_tokens_to_ids(token)]
            hidden = model.model.norm(embedding[None])[0]
            model.lm_head.weight[tok.convert_tokens_to_ids(nxt)] += 10 * hidden
    return model


def _always(model, tok, label: str):
    """A judge whose token after "[[" (the end of every verdict prefix) is always `label`."""
    return _bigram(model, tok, {"[[": label})


def _manual_p_first(model, tok, text: str, labels) -> float:
    """Independent reference: one unbatched HF forward on the rendered prompt."""
    ids = tok.encode(text + "\n" + "Verdict: [[", add_special_tokens=False)
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    a, b = (logp[tok.convert_tokens_to_ids(lab)].item() for lab in labels)
    return math.exp(a) / (math.exp(a) + math.exp(b))


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def test_exact_pairwise_and_pointwise_scores_match_a_manual_forward(tok):
    model = _model(len(tok))
    judge = GenerativeJudge(engine=None, tokenizer=tok, scorer=HFNextTokenScorer(model, batch_size=3))
    items = [(QUESTION, POLICY, ANCHOR, None), (QUESTION, ANCHOR, POLICY, "4")]
    got = judge.pairwise(items)
    for (prompt, policy, anchor, gold), res in zip(items, got):
        block = f"\n[Reference answer]\n{gold}\n" if gold else ""
        fill = lambda a, b: (DEFAULT_PAIRWISE_TEMPLATE.replace("{gold_block}", block)  # noqa: E731
                             .replace("{prompt}", prompt).replace("{response_a}", a)
                             .replace("{response_b}", b))
        p1 = _manual_p_first(model, tok, fill(policy, anchor), ("A", "B"))
        p2 = _manual_p_first(model, tok, fill(anchor, policy), ("A", "B"))
        assert res.probs == pytest.approx([p1, p2], abs=1e-5)
        assert res.score == pytest.approx(0.5 * (p1 + 1 - p2), abs=1e-5)
        assert 0.0 < res.score < 1.0 and res.score != pytest.approx(0.5, abs=1e-4)
    point = judge.pointwise([(QUESTION, POLICY, None)])[0]
    text = (DEFAULT_POINTWISE_TEMPLATE.replace("{gold_block}", "").replace("{prompt}", QUESTION)
            .replace("{response}", POLICY))
    assert point.score == pytest.approx(_manual_p_first(model, tok, text, ("Yes", "No")), abs=1e-5)


def test_position_biased_judge_scores_parity(tok):
    """A judge that always answers "A" prefers whatever comes first: both orders cancel."""
    model = _always(_model(len(tok)), tok, "A")
    judge = GenerativeJudge(engine=None, tokenizer=tok, scorer=HFNextTokenScorer(model))
    res = judge.pairwise([(QUESTION, POLICY, ANCHOR, None)])[0]
    assert res.probs == pytest.approx([1.0, 1.0], abs=1e-6) and res.score == pytest.approx(0.5)
    yes_model = _always(_model(len(tok)), tok, "Yes")
    yes_judge = GenerativeJudge(engine=None, tokenizer=tok, scorer=HFNextTokenScorer(yes_model))
    assert yes_judge.pointwise([(QUESTION, POLICY, None)])[0].score == pytest.approx(1.0)


def test_sampling_fallback_through_the_builtin_engine(tok, tmp_path):
    """The builtin engine has no next_token_logprobs: verdicts are sampled and counted."""
    model = _always(_model(len(tok)), tok, "A")
    model.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path, tokenizer=tok)
    judge = GenerativeJudge(engine, tok, JudgeConfig(n_samples=4, verdict_max_new_tokens=2))
    assert judge.scorer is None
    probs = judge.label_probs(["x", "y"], ("A", "B"))
    assert [(p.p, p.n_valid, p.n_total) for p in probs] == [(1.0, 4, 4), (1.0, 4, 4)]
    res = judge.pairwise([(QUESTION, POLICY, ANCHOR, None)])[0]
    assert res.probs == [1.0, 1.0] and res.score == 0.5
    # a judge split between "A" and "B": the estimate is the frequency among the samples
    split = _always(_model(len(tok)), tok, "A")
    with torch.no_grad():
        split.lm_head.weight[tok.convert_tokens_to_ids("B")] = split.lm_head.weight[
            tok.convert_tokens_to_ids("A")]
    split.save_pretrained(tmp_path / "split")
    engine = BuiltinEngine.from_pretrained(tmp_path / "split", tokenizer=tok)
    cfg = JudgeConfig(n_samples=16, verdict_max_new_tokens=1, seed=7)
    lp = GenerativeJudge(engine, tok, cfg).label_probs(["x"], ("A", "B"))[0]
    again = engine.generate([tok.encode("x\nVerdict: [[", add_special_tokens=False)],
                            SamplingParams(n=16, temperature=1.0, max_new_tokens=1, seed=7))
    firsts = [tok.convert_ids_to_tokens(s.response_ids[0]) for s in again]
    assert set(firsts) == {"A", "B"}
    assert (lp.p, lp.n_valid, lp.n_total) == (firsts.count("A") / 16, 16, 16)


def test_cot_mode_reads_the_verdict_after_reasoning(tok, tmp_path):
    """The judge 'reasons' ". -> Verdict -> : -> [[ -> A" (a programmed bigram chain); the
    verdict is read after the last verdict prefix, by frequency or re-scored exactly."""
    model = _bigram(_model(len(tok)), tok, {".": "Verdict", "Verdict": ":", ":": "[[", "[[": "A"})
    model.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path, tokenizer=tok)
    cfg = JudgeConfig(mode="cot", n_samples=2, max_new_tokens=5, verdict_prefix="Verdict : [[")
    sampled = GenerativeJudge(engine, tok, cfg)
    samples = engine.generate([tok.encode(render(DEFAULT_PAIRWISE_TEMPLATE, prompt=QUESTION,
                                                 response_a=POLICY, response_b=ANCHOR,
                                                 gold_block=""), add_special_tokens=False)],
                              SamplingParams(n=1, max_new_tokens=4, seed=0))
    assert samples[0].text == "Verdict : [[ A"
    res = sampled.pairwise([(QUESTION, POLICY, ANCHOR, None)])[0]
    assert res.probs == [1.0, 1.0] and res.score == 0.5
    exact = GenerativeJudge(engine, tok, cfg, scorer=HFNextTokenScorer(model))
    res = exact.pairwise([(QUESTION, POLICY, ANCHOR, None)])[0]
    assert res.probs == pytest.approx([1.0, 1.0], abs=1e-6)


def test_genrm_routes_through_the_reward_manager(tok):
    model = _model(len(tok))
    judge = GenerativeJudge(engine=None, tokenizer=tok, scorer=HFNextTokenScorer(model))
    cfg = RewardConfig.from_dict({"sources": {"general": "genrm", "pairwise": "pairwise_genrm"}})
    batch = [
        RewardInput("general", QUESTION, POLICY, reference=ANCHOR),      # pairwise vs reference
        RewardInput("general", QUESTION, POLICY),                        # no anchor: pointwise
        RewardInput("pairwise", QUESTION, POLICY, gold="4"),             # anchor = gold
        RewardInput("pairwise", QUESTION, POLICY),                       # no anchor: failure
    ]
    with RewardManager(cfg, resources={"judge": judge}) as manager:
        outputs, metrics = manager.score(batch)
    assert outputs[0].score == pytest.approx(judge.pairwise([(QUESTION, POLICY, ANCHOR, None)])[0].score)
    assert outputs[1].score == pytest.approx(judge.pointwise([(QUESTION, POLICY, None)])[0].score)
    assert outputs[2].score == pytest.approx(judge.pairwise([(QUESTION, POLICY, "4", None)])[0].score)
    assert [o.info.get("kind") for o in outputs[:3]] == ["pairwise", "pointwise", "pairwise"]
    assert outputs[3].score == 0.5 and "needs an anchor" in outputs[3].info["failure"]
    assert metrics["reward/failures"] == 1 and metrics["reward/pairwise/failures"] == 1
