"""Tool-call formats of a tool-calling rollout (docs/tools.md): how a turn's text holds calls, and
how their results come back as the observation text appended after the turn.

- `CodeFormat` (ReTool, arXiv 2504.11536): the policy writes ``<code>...</code>`` (optionally a
  ```` ```python ```` fence inside); generation stops at ``</code>``; the interpreter's output
  comes back as ``\\n<interpreter>\\n{output}\\n</interpreter>\\n``. One call per turn, tool
  ``python`` with argument ``code``.
- `ChatJsonFormat` (Qwen2.5 / Qwen3 and every chat template of that family): calls are
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks inside an assistant
  turn that ends as any turn does (EOS); several per turn run together. The results come back
  as the chat template itself renders `tool` messages after an assistant turn, ending with the
  generation prompt of the next assistant turn (`render_observation`).

A call the format cannot read (no opening tag, invalid JSON, no name, arguments not an object,
an unclosed block) is a `ToolCall` with `error` set: it is answered with that error, counted
as malformed, and never run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

PYTHON_TOOL = "python"


@dataclass
class ToolCall:
    """One call found in a turn. `error`: why it is malformed (then it is not run)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ToolResult:
    """What a call gave back. status: ok | error (the tool raised / the program failed) |
    timeout | malformed (never run: unreadable call or unknown tool)."""

    name: str
    text: str
    status: str = "ok"


class CodeFormat:
    """ReTool's code blocks (module docstring)."""

    name = "code"
    stop = ["</code>"]
    OPEN, CLOSE = "<code>", "</code>"
    _FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[^\n]*\n(.*?)\n?```\s*$", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """The call the turn ends with: the code between the last <code> and the </code> after it.
        A turn without </code> holds no call (an answer)."""
        end = text.rfind(self.CLOSE)
        if end < 0:
            return []
        start = text.rfind(self.OPEN, 0, end)
        if start < 0:
            return [ToolCall(PYTHON_TOOL, error="</code> without an opening <code>")]
        code = text[start + len(self.OPEN): end]
        fenced = self._FENCE.match(code)
        if fenced:
            code = fenced.group(1)
        if not code.strip():
            return [ToolCall(PYTHON_TOOL, error="empty <code> block")]
        return [ToolCall(PYTHON_TOOL, {"code": code.strip("\n")})]

    def observation(self, results: list[ToolResult], turn_text: str = "") -> str:
        body = "\n".join(r.text.rstrip("\n") for r in results)
        return f"\n<interpreter>\n{body}\n</interpreter>\n"


class ChatJsonFormat:
    """The chat template's own JSON tool calls (module docstring). `tokenizer` renders the tool
    messages; `tools` are the JSON schemas declared in the prompt (apply_chat_template's tools=)."""

    name = "chat_json"
    stop: list[str] = []
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _MARK = "\x00megarl-assistant-turn\x00"

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.tools.format=chat_json needs a tokenizer with a chat template")
        self.tokenizer, self.tools = tokenizer, tools or None

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                return calls
            end = text.find(self.CLOSE, start)
            if end < 0:
                calls.append(ToolCall("", error=f"{self.OPEN} without {self.CLOSE}"))
                return calls
            calls.append(self._read(text[start + len(self.OPEN): end]))
            pos = end + len(self.CLOSE)

    @staticmethod
    def _read(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", error=f"the tool call is not valid JSON: {e}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall("", error='a tool call is a JSON object with a "name" string')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates and models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(obj["name"], error='"arguments" is a string that is not JSON')
        if not isinstance(args, dict):
            return ToolCall(obj["name"], error='"arguments" must be a JSON object')
        return ToolCall(obj["name"], args)

    def observation(self, results: list[ToolResult], turn_text: str = "") -> str:
        """The chat template's text after an assistant turn: the tool messages and the next
        assistant turn's generation prompt; what the turn already generated of the text between
        (its end-of-turn token, `turn_text` decoded with special tokens) is left out."""
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": self._MARK}]
        messages += [{"role": "tool", "name": r.name, "content": r.text.rstrip("\n")} for r in results]
        kwargs = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        if self._MARK not in text:
            raise ValueError("the chat template does not render an assistant message's content as given")
        after = text[text.index(self._MARK) + len(self._MARK):]
        for k in range(min(len(after), len(turn_text)), 0, -1):
            if turn_text.endswith(after[:k]):
                return after[k:]
        return after


FORMATS = {"code": CodeFormat, "chat_json": ChatJsonFormat}


def make_format(name: str, tokenizer: Any = None, tools: list[dict] | None = None):
    """The format of rollout.tools.format."""
    if name == "code":
        return CodeFormat()
    if name == "chat_json":
        return ChatJsonFormat(tokenizer, tools)
    raise ValueError(f"rollout.tools.format: unknown format {name!r}; one of {sorted(FORMATS)}")
