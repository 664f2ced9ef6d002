"""The built-in Python interpreter tool: every call runs in megarl's sandbox
(megarl/rewards/sandbox.py: namespaces, seccomp, time / memory / output limits; the warm zygote
path where it runs), as a fresh process.

State per trajectory (ReTool's interpreter keeps variables between a trajectory's calls): with
`keep_state`, a call first re-runs the trajectory's earlier cells that ran to completion or
raised (not those that timed out), their output discarded and their exceptions swallowed, then
runs the new cell in the same globals. Deterministic code gets exactly the state a persistent
interpreter would have; code that draws random numbers or reads the clock gets fresh draws.
The time limit covers the re-run and the new cell together.

Result text: the cell's stdout; when it raises, stdout then the exception's last line
(``NameError: name 'x' is not defined``), status "error"; past the time limit
"Error: timed out after N s", status "timeout"; past the memory limit "MemoryError", status
"error".
"""

from __future__ import annotations

import json
import logging

from megarl.rewards.sandbox import Limits, SandboxUnavailable, run_python
from megarl.rollout.tool_calls import PYTHON_TOOL, ToolCall, ToolResult

log = logging.getLogger(__name__)

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL,
        "description": "Run Python code and return what it prints (variables persist between calls).",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
                       "required": ["code"]},
    },
}

# main.py of a call: replays cells.json's earlier cells silently, then runs the last one
_RUNNER = r'''import contextlib, io, json, sys, traceback
_cells = json.load(open("cells.json"))
_g = {"__name__": "__main__", "__builtins__": __builtins__}
for _c in _cells[:-1]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(_c, "<cell>", "exec"), _g)
        except BaseException:
            pass
try:
    exec(compile(_cells[-1], "<cell>", "exec"), _g)
except SystemExit:
    raise
except BaseException as _e:
    sys.stdout.flush()
    print("".join(traceback.format_exception_only(type(_e), _e)).strip(), file=sys.stderr)
    sys.exit(1)
'''


class PythonInterpreter:
    """tool(call, history) -> ToolResult for `python` calls with argument `code`."""

    name = PYTHON_TOOL

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, keep_state: bool = True,
                 max_output_bytes: int = 1 << 16) -> None:
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
        self.keep_state = keep_state

    def cells(self, call: ToolCall, history: list[tuple[ToolCall, ToolResult]]) -> list[str]:
        """The cells a call runs: the earlier ones that completed or raised (keep_state), then its own."""
        earlier = [c.arguments["code"] for c, r in history if self.keep_state and c.name == self.name
                   and r.status in ("ok", "error") and isinstance(c.arguments.get("code"), str)]
        return earlier + [call.arguments["code"]]

    def __call__(self, call: ToolCall, history: list[tuple[ToolCall, ToolResult]]) -> ToolResult:
        code = call.arguments.get("code")
        if not isinstance(code, str) or set(call.arguments) != {"code"}:
            return ToolResult(self.name, "Error: the python tool takes one argument, code (a string)", "error")
        try:
            r = run_python(_RUNNER, limits=self.limits, files={"cells.json": json.dumps(self.cells(call, history))})
        except SandboxUnavailable as e:
            log.warning("python tool: the sandbox cannot run code: %s", e)
            return ToolResult(self.name, "Error: the interpreter is unavailable", "error")
        if r.status == "ok":
            return ToolResult(self.name, r.stdout)
        if r.status == "timeout":
            return ToolResult(self.name, f"{r.stdout}Error: timed out after {self.limits.timeout_s:g} s", "timeout")
        if r.status == "memory":
            return ToolResult(self.name, f"{r.stdout}MemoryError", "error")
        if r.status == "killed" and "output limit" in r.stderr:
            return ToolResult(self.name, f"{r.stdout}\nError: output limit exceeded", "error")
        tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit status {r.returncode}"]
        return ToolResult(self.name, f"{r.stdout}{tail[0]}", "error")
