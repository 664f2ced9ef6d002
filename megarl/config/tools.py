"""The `rollout.tools` section of the config tree (megarl.config.schema)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.fields import doc_field


@dataclass
class ToolsConfig:
    """Tool-calling rollouts, ReTool (arXiv 2504.11536) and chat-template tool calls (docs/tools.md;
    megarl/rollout/tool_loop.py, megarl/tool_runtime/, megarl/trainer/tools.py)."""

    enable: bool = doc_field(
        False, "multi-turn tool-calling rollouts: generate until a tool call closes, run it, append its result as "
        "observation tokens (no loss, value, KL or entropy), continue until an answer, max_turns or the budget")
    format: Literal["code", "chat_json"] = doc_field(
        "code", "code: ReTool's <code>...</code> -> <interpreter>...</interpreter> (the python tool); chat_json: the "
        "chat template's own JSON calls (Qwen2.5 / Qwen3 <tool_call> -> <tool_response>), tools declared through "
        "apply_chat_template(tools=...)")
    max_turns: int = doc_field(8, "model turns per trajectory; a call on the last one is not run (the sample ends on "
                                  "the turn budget)")
    max_response_tokens: int | None = doc_field(
        None, "token budget of a whole response (every turn and observation); null = rollout.max_new_tokens (eval: "
        "eval.max_new_tokens); a turn generates at most rollout.max_new_tokens of it")
    python: bool = doc_field(True, "offer the built-in sandboxed Python interpreter as tool `python` (the code format "
                                   "always does)")
    keep_state: bool = doc_field(
        True, "the interpreter keeps a trajectory's variables between calls (its earlier cells re-run silently first); "
        "false = every call starts fresh")
    timeout_s: float = doc_field(5.0, "wall-clock limit of one tool call (an interpreter run or a user function)")
    memory_mb: int = doc_field(512, "the interpreter's memory limit (address space, MiB)")
    max_output_chars: int = doc_field(1024, "an observation keeps at most this many characters of a tool's output "
                                            "(head and tail)")
    functions: dict[str, str] = doc_field(
        {}, "user tools, name -> 'package.module:function' (JSON arguments as keywords, returns text); a crash, "
        "timeout or bad argument is an error observation, counted")
    max_workers: int = doc_field(8, "tool calls of a round run concurrently in this many threads per rank")
    malformed_penalty: float = doc_field(
        0.0, "subtracted from a sample's score per malformed call (unreadable, unknown tool); 0 = off (ReTool: none)")
    budget_penalty: float = doc_field(
        0.0, "subtracted from the score of a sample that ends on the turn or response budget; 0 = off (ReTool: none)")
