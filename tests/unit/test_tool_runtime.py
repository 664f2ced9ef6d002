"""What runs a policy's tool calls (megarl/tool_runtime): the sandboxed interpreter with its state
per trajectory, user tools by dotted path, and the ToolBox that runs a round concurrently and
turns every failure into a counted error observation."""

from __future__ import annotations

import time

import pytest

from megarl.rollout.tool_calls import ToolCall, ToolResult
from megarl.rollout.tool_loop import ToolRequest
from megarl.tool_runtime import FunctionTool, PythonInterpreter, ToolBox, function_schema, truncate
from tests.unit import tool_fixtures as fx


def py(code: str) -> ToolCall:
    return ToolCall("python", {"code": code})


def test_interpreter_prints_errors_and_limits():
    tool = PythonInterpreter(timeout_s=2.0)
    assert tool(py("print(347*851)"), []) == ToolResult("python", "295297\n", "ok")
    r = tool(py("print('before')\nprint(undefined)"), [])
    assert (r.status, r.text) == ("error", "before\nNameError: name 'undefined' is not defined")
    assert tool(py("x = ("), []).text.startswith("SyntaxError")
    r = tool(py("while True:\n    pass"), [])
    assert (r.status, r.text) == ("timeout", "Error: timed out after 2 s")
    assert tool(ToolCall("python", {"code": 1}), []).status == "error"  # bad argument, never run
    assert tool(ToolCall("python", {"code": "print(1)", "extra": 2}), []).status == "error"


def test_interpreter_keeps_a_trajectorys_variables():
    tool = PythonInterpreter(timeout_s=5.0)
    first = py("a = 347\nprint('set')")
    history = [(first, tool(first, [])), (py("b = 1/0"), ToolResult("python", "ZeroDivisionError", "error")),
               (py("while True: pass"), ToolResult("python", "", "timeout"))]
    r = tool(py("print(a * 851)"), history)
    assert (r.status, r.text) == ("ok", "295297\n")  # earlier output not repeated; the timed-out cell not re-run
    assert tool.cells(py("x"), history) == ["a = 347\nprint('set')", "b = 1/0", "x"]
    fresh = PythonInterpreter(keep_state=False)
    assert fresh(py("print(a)"), history).status == "error"


def test_user_tools_report_crashes_bad_arguments_and_timeouts():
    assert FunctionTool("add", fx.add)(ToolCall("add", {"a": 2, "b": 3}), []) == ToolResult("add", "5")
    assert FunctionTool("lookup", fx.lookup)(ToolCall("lookup", {"key": "ab"}), []).text == '{"key": "ab", "value": 2}'
    r = FunctionTool("add", fx.add)(ToolCall("add", {"a": 1}), [])
    assert r.status == "error" and "bad arguments" in r.text
    r = FunctionTool("boom", fx.boom)(ToolCall("boom", {}), [])
    assert (r.status, r.text) == ("error", "Error: RuntimeError: the tool crashed")
    t0 = time.monotonic()
    r = FunctionTool("slow", fx.slow, timeout_s=0.3)(ToolCall("slow", {}), [])
    assert r.status == "timeout" and time.monotonic() - t0 < 2


def test_schemas_from_docstrings_attributes_or_signatures():
    s = function_schema("plus", fx.add)["function"]
    assert s["name"] == "plus" and s["parameters"]["properties"]["a"]["type"] == "integer"
    assert s["parameters"]["required"] == ["a", "b"]
    s = function_schema("lookup", fx.lookup)["function"]  # no hints, no docstring: from the signature
    assert s["parameters"]["properties"] == {"key": {"type": "string"}}
    fx.lookup.tool_schema = {"name": "other", "description": "d", "parameters": {"type": "object", "properties": {}}}
    try:
        assert function_schema("lookup", fx.lookup) == {"type": "function", "function": {
            "name": "lookup", "description": "d", "parameters": {"type": "object", "properties": {}}}}
    finally:
        del fx.lookup.tool_schema


def test_toolbox_runs_a_round_concurrently_and_never_raises():
    def crash(call, history):
        raise ValueError("not caught by the tool")

    box = ToolBox({"slow": FunctionTool("slow", fx.slow, timeout_s=5), "crash": crash}, max_workers=4,
                  max_output_chars=64)
    t0 = time.monotonic()
    out = box([ToolRequest(ToolCall("slow", {"seconds": 0.6}), []) for _ in range(4)])
    assert [r.text for r in out] == ["done"] * 4 and time.monotonic() - t0 < 2.0  # together, not 2.4 s in a row
    bad = box([ToolRequest(ToolCall("nope", {}), []), ToolRequest(ToolCall("", error="not JSON"), []),
               ToolRequest(ToolCall("crash", {}), [])])
    assert [r.status for r in bad] == ["malformed", "malformed", "error"]
    assert "unknown tool 'nope'" in bad[0].text and bad[1].text == "Error: not JSON"


def test_truncate_keeps_head_and_tail():
    assert truncate("short", 10) == "short"
    t = truncate("a" * 50 + "b" * 50, 20)
    assert t.startswith("a" * 10) and t.endswith("b" * 10) and "80 characters cut" in t
    with pytest.raises(ValueError):
        ToolBox({}, max_workers=0)
