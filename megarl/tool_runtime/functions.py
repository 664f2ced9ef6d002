"""User tools by dotted path (`rollout.tools.functions: {search: mypkg.tools:search}`): a function
of the call's JSON arguments (keyword arguments) that returns text (anything else is written
as JSON, or str() where JSON cannot hold it).

A call runs in a daemon thread of the rank's process with a wall-clock limit: a call that
raises, does not bind to the function's parameters, or does not return in time becomes an error
observation (status "error" / "timeout") and is counted; a thread that never returns is left
behind (Python cannot stop one), so a user tool that can hang should enforce its own timeout too.
The declaration the chat template shows the policy (`function_schema`) is the function's
`tool_schema` attribute when it has one, else transformers' `get_json_schema` (type hints and a
Google-style docstring), else one built from the signature (every parameter a string unless
annotated int / float / bool / list / dict).
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import Any, Callable

from megarl.rollout.tool_calls import ToolCall, ToolResult

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", list: "array", dict: "object", str: "string"}


class FunctionTool:
    """tool(call, history) -> ToolResult for a user function (module docstring)."""

    def __init__(self, name: str, fn: Callable[..., Any], timeout_s: float = 10.0) -> None:
        self.name, self.fn, self.timeout_s = name, fn, timeout_s
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None

    def __call__(self, call: ToolCall, history: list[tuple[ToolCall, ToolResult]]) -> ToolResult:
        if self.signature is not None:
            try:
                self.signature.bind(**call.arguments)
            except TypeError as e:
                return ToolResult(self.name, f"Error: bad arguments for {self.name}: {e}", "error")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = self.fn(**call.arguments)
            except BaseException as e:  # noqa: BLE001 - a user tool's crash is an observation, never the step's
                box["error"] = e

        thread = threading.Thread(target=target, name=f"megarl-tool-{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            return ToolResult(self.name, f"Error: {self.name} timed out after {self.timeout_s:g} s", "timeout")
        if "error" in box:
            e = box["error"]
            return ToolResult(self.name, f"Error: {type(e).__name__}: {e}", "error")
        return ToolResult(self.name, as_text(box.get("value")))


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def function_schema(name: str, fn: Callable[..., Any]) -> dict:
    """The tool declaration of `fn` under `name` (module docstring), in the OpenAI function format
    that chat templates read ({"type": "function", "function": {name, description, parameters}})."""
    schema = getattr(fn, "tool_schema", None)
    if schema is None:
        try:
            from transformers.utils import get_json_schema

            schema = get_json_schema(fn)
        except Exception:  # noqa: BLE001 - no usable docstring / hints: build one from the signature
            schema = None
    if schema is None:
        params = {}
        try:
            for p in inspect.signature(fn).parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                params[p.name] = {"type": _JSON_TYPES.get(p.annotation, "string")}
            required = [p.name for p in inspect.signature(fn).parameters.values()
                        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            required = []
        doc = (inspect.getdoc(fn) or name).strip().splitlines()[0]
        schema = {"type": "function", "function": {"name": name, "description": doc,
                                                    "parameters": {"type": "object", "properties": params,
                                                                   "required": required}}}
    schema = json.loads(json.dumps(schema))  # a copy; plain JSON
    body = schema.get("function", schema)
    body["name"] = name  # the config's name is the one the policy calls
    return schema if "function" in schema else {"type": "function", "function": body}
