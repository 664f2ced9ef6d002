"""Generative reward models: a judge LLM served by a RolloutEngine.

Scores (docs/algorithms.md §6, §7):
- pairwise, against an anchor (a reference response, or the gold answer): both orders are
  judged to cancel position bias and
      r = ½·(P(policy ≻ anchor | policy first) + 1 − P(anchor ≻ policy | anchor first)),
  in [0, 1], 0.5 = parity with the anchor. A judge that always prefers one position scores 0.5.
- pointwise (no anchor): r = P("Yes" | prompt, response), the judged probability that the
  response is acceptable.

What the judge needs from the engine. `P(label)` is the probability mass on the verdict token,
renormalised over the two labels: p = exp(l₁) / (exp(l₁) + exp(l₂)). Two ways to get it:
1. Exact: the engine (or a separate `scorer`) implements `NextTokenScorer.next_token_logprobs
   (prompts, candidates) -> [[log p(candidate | prompt)]]`: the log-probability of each candidate
   token id as the next token after each prompt, from the model's full next-token distribution
   at temperature 1 (no top-k / top-p). `HFNextTokenScorer` implements it for a HF model.
2. Fallback [NS→C]: sample `n_samples` verdicts with `RolloutEngine.generate` and use the
   empirical frequency of the first label among valid verdicts (a noisy estimate; n = 8 gives a
   standard error up to 0.18).

Modes: "direct" renders the judge prompt followed by `verdict_prefix` (e.g. "Verdict: [[") so the
next token is the verdict; "cot" lets the judge reason first (`max_new_tokens`), then reads the
verdict after the last `verdict_prefix` in each sample (exact mode: re-scores that position).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from megarl.rewards.types import RewardError
from megarl.rollout.types import SamplingParams

DEFAULT_PAIRWISE_TEMPLATE = """You are an impartial judge. Compare two responses to the request below.
{gold_block}
[Request]
{prompt}

[Response A]
{response_a}

[Response B]
{response_b}

Decide which response is better: correct, helpful and well reasoned. Neither the order nor the \
length of the responses should influence you. End with "Verdict: [[A]]" if Response A is better \
or "Verdict: [[B]]" if Response B is better."""

DEFAULT_POINTWISE_TEMPLATE = """You are a strict grader. Judge whether the response correctly and \
helpfully answers the request.
{gold_block}
[Request]
{prompt}

[Response]
{response}

End with "Verdict: [[Yes]]" if the response is correct and helpful, or "Verdict: [[No]]" otherwise."""

GOLD_BLOCK = "\n[Reference answer]\n{gold}\n"


@runtime_checkable
class NextTokenScorer(Protocol):
    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        """[i][j] = log p(candidates[j] | prompts[i]) under the full next-token distribution."""


@dataclass
class JudgeConfig:
    mode: str = "direct"  # "direct" | "cot"
    n_samples: int = 8  # verdict samples when estimating by frequency (and in cot mode)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024  # cot mode: reasoning budget
    verdict_max_new_tokens: int = 4  # direct mode, sampling fallback
    use_chat_template: bool = True
    verdict_prefix: str = "Verdict: [["
    pair_labels: tuple[str, str] = ("A", "B")
    point_labels: tuple[str, str] = ("Yes", "No")
    pairwise_template: str = DEFAULT_PAIRWISE_TEMPLATE
    pointwise_template: str = DEFAULT_POINTWISE_TEMPLATE
    max_response_chars: int = 16000  # longer responses keep their last max_response_chars chars
    seed: int | None = 0

    def __post_init__(self) -> None:
        if self.mode not in ("direct", "cot"):
            raise ValueError(f"JudgeConfig.mode must be 'direct' or 'cot', got {self.mode!r}")
        if self.n_samples < 1:
            raise ValueError(f"JudgeConfig.n_samples must be >= 1, got {self.n_samples}")
        for name, fields in (("pairwise_template", ("{prompt}", "{response_a}", "{response_b}")),
                             ("pointwise_template", ("{prompt}", "{response}"))):
            missing = [f for f in fields if f not in getattr(self, name)]
            if missing:
                raise ValueError(f"JudgeConfig.{name} lacks the placeholders {missing}")


def judge_config(options: dict | None, where: str = "judge") -> JudgeConfig:
    """JudgeConfig from a mapping (e.g. reward.judge of a config); an error names the field."""
    from dataclasses import fields as dc_fields

    options = dict(options or {})
    known = {f.name for f in dc_fields(JudgeConfig)}
    unknown = sorted(set(options) - known - {"exact"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} (known: {sorted(known | {'exact'})})")
    options.pop("exact", None)
    for name in ("pair_labels", "point_labels"):
        if name in options:
            labels = options[name]
            if not isinstance(labels, (list, tuple)) or len(labels) != 2 or not all(isinstance(x, str) for x in labels):
                raise ValueError(f"{where}.{name} must be two strings, got {labels!r}")
            options[name] = tuple(labels)
    try:
        return JudgeConfig(**options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


@dataclass
class LabelProb:
    """P(first label) over the valid verdicts of one judge prompt (None if none was valid)."""

    p: float | None
    n_valid: int
    n_total: int


@dataclass
class JudgeResult:
    score: float
    probs: list[float] = field(default_factory=list)  # per order (pairwise) or [P(yes)]


def pairwise_score(p_policy_first: float, p_anchor_first: float) -> float:
    """r = ½·(P(policy ≻ anchor | policy first) + 1 − P(anchor ≻ policy | anchor first)),
    where each argument is the probability that the judge prefers the FIRST response."""
    return 0.5 * (p_policy_first + 1.0 - p_anchor_first)


def two_label_prob(logp_first: float, logp_second: float) -> float:
    """exp(l₁) / (exp(l₁) + exp(l₂)) = sigmoid(l₁ − l₂), computed without overflow."""
    d = logp_first - logp_second
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def render(template: str, **fields: str) -> str:
    """Fills `{name}` placeholders; braces inside the field values are kept verbatim."""
    return re.sub(r"\{(\w+)\}", lambda m: fields[m.group(1)] if m.group(1) in fields else m.group(0),
                  template)


def parse_first_label(text: str, labels: Sequence[str]) -> int | None:
    """Index of the label the continuation of a verdict prefix starts with (direct mode)."""
    m = re.match(r"\s*(" + "|".join(map(re.escape, labels)) + r")(?![A-Za-z])", text)
    return None if m is None else list(labels).index(m.group(1))


def parse_verdict(text: str, labels: Sequence[str], prefix: str) -> int | None:
    """Index of the label in the last `prefix label` of a reasoned judgement (cot mode)."""
    at = text.rfind(prefix.rstrip())
    if at < 0:
        return None
    return parse_first_label(text[at + len(prefix.rstrip()):], labels)


class GenerativeJudge:
    """A judge LLM behind a RolloutEngine (+ optional NextTokenScorer for exact probabilities)."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: JudgeConfig | None = None,
                 scorer: NextTokenScorer | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.cfg = cfg or JudgeConfig()
        if scorer is None and isinstance(engine, NextTokenScorer):
            scorer = engine
        self.scorer = scorer

    # ---------------------------------------------------------------- public scores
    def pairwise(self, items: Sequence[tuple[str, str, str, str | None]]) -> list[JudgeResult | None]:
        """items: (prompt, policy response, anchor response, gold or None) -> score per item,
        None where either order produced no valid verdict."""
        texts = [self._pairwise_text(prompt, a, b, gold) for prompt, policy, anchor, gold in items
                 for a, b in ((policy, anchor), (anchor, policy))]
        probs = self.label_probs(texts, self.cfg.pair_labels)
        out = []
        for i in range(len(items)):
            first, second = probs[2 * i].p, probs[2 * i + 1].p
            ok = first is not None and second is not None
            out.append(JudgeResult(pairwise_score(first, second), [first, second]) if ok else None)
        return out

    def pointwise(self, items: Sequence[tuple[str, str, str | None]]) -> list[JudgeResult | None]:
        """items: (prompt, response, gold or None) -> P(first point label), None if no verdict."""
        texts = [render(self.cfg.pointwise_template, prompt=p, response=self._clip(r),
                        gold_block=self._gold_block(g)) for p, r, g in items]
        return [None if lp.p is None else JudgeResult(lp.p, [lp.p])
                for lp in self.label_probs(texts, self.cfg.point_labels)]

    def pairwise_input_text(self, prompt: str, response_a: str, response_b: str, gold: str | None = None) -> str:
        """The text whose next token is the verdict in direct mode (chat-rendered judge prompt +
        verdict prefix): what a judge is trained on (megarl.trainer.genrm_train)."""
        return self._render_chat(self._pairwise_text(prompt, response_a, response_b, gold)) + self.cfg.verdict_prefix

    def _pairwise_text(self, prompt: str, a: str, b: str, gold: str | None) -> str:
        return render(self.cfg.pairwise_template, prompt=prompt, response_a=self._clip(a),
                      response_b=self._clip(b), gold_block=self._gold_block(gold))

    # ---------------------------------------------------------------- probabilities
    def label_probs(self, texts: list[str], labels: tuple[str, str]) -> list[LabelProb]:
        label_ids = [self._single_token(lab) for lab in labels]
        prompts = [self._render_chat(t) for t in texts]
        cfg = self.cfg
        if cfg.mode == "direct":
            ids = [self._encode(p + cfg.verdict_prefix) for p in prompts]
            if self.scorer is not None:
                return [LabelProb(two_label_prob(*lp), 1, 1)
                        for lp in self.scorer.next_token_logprobs(ids, label_ids)]
            samples = self._generate(ids, cfg.verdict_max_new_tokens)
            return self._frequencies(samples, len(ids), lambda s: parse_first_label(s.text, labels))
        ids = [self._encode(p) for p in prompts]
        samples = self._generate(ids, cfg.max_new_tokens)
        if self.scorer is None:
            return self._frequencies(samples, len(ids),
                                     lambda s: parse_verdict(s.text, labels, cfg.verdict_prefix))
        prefixes, owners = [], []
        for s in samples:
            at = s.text.rfind(cfg.verdict_prefix)
            if at >= 0:
                head = s.text[: at + len(cfg.verdict_prefix)]
                prefixes.append(ids[s.index] + self._encode(head))
                owners.append(s.index)
        scored = self.scorer.next_token_logprobs(prefixes, label_ids) if prefixes else []
        per_prompt: list[list[float]] = [[] for _ in ids]
        for owner, lp in zip(owners, scored):
            per_prompt[owner].append(two_label_prob(*lp))
        return [LabelProb(sum(v) / len(v) if v else None, len(v), cfg.n_samples) for v in per_prompt]

    # ---------------------------------------------------------------- helpers
    def _generate(self, ids: list[list[int]], max_new_tokens: int):
        cfg = self.cfg
        sampling = SamplingParams(n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                                  max_new_tokens=max_new_tokens, seed=cfg.seed)
        samples = self.engine.generate(ids, sampling)
        for s in samples:
            if not s.text:
                s.text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        return samples

    @staticmethod
    def _frequencies(samples, n_prompts: int, parse) -> list[LabelProb]:
        counts = [[0, 0, 0] for _ in range(n_prompts)]  # first, second, total
        for s in samples:
            verdict = parse(s)
            counts[s.index][2] += 1
            if verdict is not None:
                counts[s.index][verdict] += 1
        return [LabelProb(a / (a + b) if a + b else None, a + b, n) for a, b, n in counts]

    def _single_token(self, label: str) -> int:
        ids = self._encode(label)
        if len(ids) != 1:
            raise ValueError(f"JudgeConfig label {label!r} must encode to one token, got {ids}")
        return ids[0]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render_chat(self, text: str) -> str:
        if self.cfg.use_chat_template and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text + "\n"

    def _clip(self, text: str) -> str:
        n = self.cfg.max_response_chars
        return text if len(text) <= n else "..." + text[-n:]

    @staticmethod
    def _gold_block(gold: str | None) -> str:
        return render(GOLD_BLOCK, gold=gold) if gold else ""


class HFNextTokenScorer:
    """NextTokenScorer over a transformers causal LM (left-padded batches, fp32 log-softmax)."""

    def __init__(self, model: Any, batch_size: int = 8, pad_id: int = 0):
        self.model, self.batch_size, self.pad_id = model, batch_size, pad_id

    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        import torch

        out: list[list[float]] = []
        device = next(self.model.parameters()).device
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start : start + self.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):
                if not p:
                    raise RewardError(f"next_token_logprobs: prompt {start + i} is empty")
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    position_ids=positions.to(device)).logits[:, -1].float()
            logp = torch.log_softmax(logits, dim=-1)[:, candidates]
            out += logp.cpu().tolist()
        return out
