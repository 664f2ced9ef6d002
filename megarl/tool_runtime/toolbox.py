"""ToolBox: the executor of a tool-calling rollout (megarl/rollout/tool_loop.py). It runs a
round's calls concurrently (`max_workers` threads per rank; the interpreter's programs run in
the sandbox, user functions in threads of their own) and never raises: an unknown tool or a
malformed call (status "malformed"), a crash or bad arguments ("error") and a timeout
("timeout") each come back as an error observation. Every observation keeps at most
`max_output_chars` characters (`truncate`)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from megarl.rollout.tool_calls import ToolCall, ToolResult
from megarl.rollout.tool_loop import ToolRequest

log = logging.getLogger(__name__)

Tool = Callable[[ToolCall, list[tuple[ToolCall, ToolResult]]], ToolResult]


def truncate(text: str, max_chars: int) -> str:
    """`text` if it fits, else its head and tail around a note of how much was cut (max_chars in all,
    up to the note's own length)."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars // 2, max_chars - max_chars // 2
    return f"{text[:head]}\n...[{len(text) - max_chars} characters cut]...\n{text[len(text) - tail:] if tail else ''}"


class ToolBox:
    """tools: name -> tool(call, history) -> ToolResult."""

    def __init__(self, tools: dict[str, Tool], max_workers: int = 8, max_output_chars: int = 1024) -> None:
        if max_workers < 1 or max_output_chars < 1:
            raise ValueError(f"ToolBox: max_workers and max_output_chars must be >= 1, got {max_workers}, "
                             f"{max_output_chars}")
        self.tools, self.max_output_chars = dict(tools), max_output_chars
        self.max_workers = max_workers

    @property
    def names(self) -> list[str]:
        return sorted(self.tools)

    def run_one(self, request: ToolRequest) -> ToolResult:
        call = request.call
        if call.error is not None:
            return ToolResult(call.name or "?", f"Error: {call.error}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; the tools are {', '.join(self.names)}",
                              "malformed")
        try:
            result = tool(call, request.history)
        except Exception as e:  # noqa: BLE001 - never the step's end
            log.warning("tool %s raised outside its own error handling: %s", call.name, e)
            result = ToolResult(call.name, f"Error: {type(e).__name__}: {e}", "error")
        return ToolResult(result.name, truncate(result.text, self.max_output_chars), result.status)

    def __call__(self, requests: list[ToolRequest]) -> list[ToolResult]:
        if len(requests) <= 1:
            return [self.run_one(r) for r in requests]
        with ThreadPoolExecutor(min(self.max_workers, len(requests)), thread_name_prefix="megarl-tools") as ex:
            return list(ex.map(self.run_one, requests))
