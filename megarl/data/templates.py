"""Prompt templates: a registry of functions `problem text -> prompt text`, and tokenisation.

Registered templates:

- ``dapo``  — the DAPO-Math-17k wrapper (the "Answer:" variant, see data/README.md).
- ``boxed`` — asks for the final answer in ``\\boxed{}`` (Qwen2.5-Math style instruction).
- ``raw``   — the problem text unchanged.
- ``arith`` — the quickstart arithmetic task (`megarl.tasks.arith`): ``"Q: 347+85=?\\n"``.

`render_prompt` turns a templated prompt into token ids, optionally through the tokenizer's chat
template (one user turn + the generation prompt).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

TemplateFn = Callable[[str], str]

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _dapo(problem: str) -> str:
    return DAPO_PREFIX + problem + DAPO_SUFFIX


def _boxed(problem: str) -> str:
    return problem + BOXED_SUFFIX


def _raw(problem: str) -> str:
    return problem


def _arith(problem: str) -> str:
    return f"Q: {problem}=?\n"


TEMPLATES: dict[str, TemplateFn] = {"dapo": _dapo, "boxed": _boxed, "raw": _raw, "arith": _arith}


def register_template(name: str, fn: TemplateFn, *, overwrite: bool = False) -> None:
    if name in TEMPLATES and not overwrite:
        raise ValueError(f"prompt template {name!r} is already registered")
    TEMPLATES[name] = fn


def get_template(name: str) -> TemplateFn:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise KeyError(f"unknown prompt template {name!r}; registered: {sorted(TEMPLATES)}") from None


def apply_template(name: str, problem: str) -> str:
    return get_template(name)(problem)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


_warned_no_chat_template: set[str] = set()


def render_text(item: Any, template: str) -> str:
    """The templated prompt text of `item` (a PromptItem or a bare problem string)."""
    problem = item if isinstance(item, str) else item.prompt
    return apply_template(template, problem)


def render_prompt(item: Any, template: str, tokenizer: Any, apply_chat_template: bool,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids of the prompt for `item` (a PromptItem or a problem string).

    With `apply_chat_template` and a tokenizer that has a chat template, the templated text is
    sent as a user message with ``add_generation_prompt=True``, after the earlier messages of a
    chat-list prompt (`item.messages`). Otherwise the text is encoded
    with the tokenizer's own special-token convention (``add_special_tokens=True``: Llama adds
    BOS, Qwen adds nothing). Asking for a chat template the tokenizer lacks logs a warning once
    per tokenizer and falls back to plain encoding. `tools` (JSON schemas; tool-calling rollouts in
    the chat_json format) are declared through the chat template (`apply_chat_template(tools=...)`).
    """
    text = render_text(item, template)
    if apply_chat_template and has_chat_template(tokenizer):
        earlier = list(getattr(item, "messages", None) or [])[:-1]  # a chat-list prompt's turns before its last
        ids = tokenizer.apply_chat_template(
            earlier + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
            **({"tools": tools} if tools else {})
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    if apply_chat_template:
        key = str(getattr(tokenizer, "name_or_path", "")) or type(tokenizer).__name__
        if key not in _warned_no_chat_template:
            _warned_no_chat_template.add(key)
            logger.warning("apply_chat_template requested but tokenizer %r has no chat template; "
                           "encoding the templated prompt as plain text", key)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
