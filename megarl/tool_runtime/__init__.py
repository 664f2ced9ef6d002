"""What runs a policy's tool calls during rollouts (docs/tools.md): the sandboxed Python
interpreter (`interpreter.py`), user tools by dotted path (`functions.py`), and `ToolBox`, which
runs a round's calls concurrently and turns every crash, timeout, bad argument and unknown tool
into an error observation (`toolbox.py`). Layered above megarl.rewards (it uses its sandbox) and
below megarl.trainer (which builds a ToolBox from rollout.tools)."""

from megarl.tool_runtime.functions import FunctionTool, function_schema
from megarl.tool_runtime.interpreter import PYTHON_SCHEMA, PythonInterpreter
from megarl.tool_runtime.toolbox import ToolBox, truncate

__all__ = ["FunctionTool", "PYTHON_SCHEMA", "PythonInterpreter", "ToolBox", "function_schema", "truncate"]
