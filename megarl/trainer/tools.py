"""Tool-calling rollouts in the trainer (rollout.tools.*, docs/tools.md): the worker's engine runs
megarl.rollout.tool_loop with a ToolBox of megarl.tool_runtime, the final answers are scored
by the reward manager, and the trajectories carry their observation tokens as `template_mask`
(1 = appended by the environment: no loss, no value target, no KL or entropy term, excluded from
the engine/trainer log-prob comparison; GAE skips them, so values and advantages pass through
an observation unchanged, as ReTool's masked GAE does).

Score of a sample: the verifier's score of what the policy wrote (every turn, the observations
left out; the DAPO overlong shaping, when on, on the whole response), minus
rollout.tools.malformed_penalty per malformed call and rollout.tools.budget_penalty when the
sample ended on the turn or response budget (both 0 by default, as ReTool uses neither).

Metrics (`tool_stats` per trajectory, then over the batch; eval: eval/<set>/tools/...):
calls_per_sample, call_rate (share of samples with a call), turns, obs_tokens (per sample),
malformed_per_sample, <tool>/calls_per_sample, <tool>/error_rate and <tool>/timeout_rate (over
that tool's calls), accuracy_with_call / accuracy_without_call, turn_budget_frac,
response_budget_frac, length_frac.
"""

from __future__ import annotations

from types import SimpleNamespace

from megarl.config import MegaRLConfig
from megarl.registry import import_object
from megarl.rollout.tool_calls import make_format
from megarl.rollout.tool_loop import ToolTrajectory, tool_rollout
from megarl.tool_runtime import PYTHON_SCHEMA, FunctionTool, PythonInterpreter, ToolBox, function_schema
from megarl.trainer.batch import Trajectory


# ---- building ---------------------------------------------------------------------------------
def user_functions(cfg: MegaRLConfig) -> dict:
    """name -> the callable of rollout.tools.functions (imported; a bad path fails naming the field)."""
    return {name: import_object(path, f"rollout.tools.functions.{name}") for name, path in cfg.rollout.tools.functions.items()}


def build_toolbox(cfg: MegaRLConfig) -> ToolBox:
    t = cfg.rollout.tools
    tools = {name: FunctionTool(name, fn, t.timeout_s) for name, fn in user_functions(cfg).items()}
    if t.python:
        tools[PythonInterpreter.name] = PythonInterpreter(t.timeout_s, t.memory_mb, t.keep_state)
    return ToolBox(tools, t.max_workers, t.max_output_chars)


def tool_schemas(cfg: MegaRLConfig) -> list[dict] | None:
    """The tool declarations the prompt shows (apply_chat_template's tools=): chat_json only."""
    t = cfg.rollout.tools
    if not t.enable or t.format != "chat_json":
        return None
    schemas = [PYTHON_SCHEMA] if t.python else []
    return schemas + [function_schema(name, fn) for name, fn in user_functions(cfg).items()]


# ---- rollout ----------------------------------------------------------------------------------
def generate_turns(worker, prompts: list[list[int]], sampling) -> list[ToolTrajectory]:
    """Tool-calling trajectories for `prompts` on the worker's engine (megarl.rollout.tool_loop)."""
    t, tok = worker.cfg.rollout.tools, worker.tokenizer
    if getattr(worker, "toolbox", None) is None:
        worker.toolbox = build_toolbox(worker.cfg)
        worker.tool_format = make_format(t.format, tok, tool_schemas(worker.cfg))
    return tool_rollout(worker.engine, prompts, sampling, worker.tool_format, worker.toolbox, t.max_turns,
                        encode=lambda text: list(tok.encode(text, add_special_tokens=False)),
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                        decode_raw=lambda ids: tok.decode(ids, skip_special_tokens=False),
                        budget=t.max_response_tokens)


def tool_stats(t: ToolTrajectory) -> dict:
    """Plain per-trajectory counts (Trajectory.tool_stats): turns, observation tokens, how it ended,
    and per tool its calls, errors and timeouts; malformed calls under `malformed`."""
    per: dict[str, dict[str, int]] = {}
    malformed = 0
    for call, result in t.calls:
        if result.status == "malformed":
            malformed += 1
            continue
        c = per.setdefault(call.name, {"calls": 0, "errors": 0, "timeouts": 0})
        c["calls"] += 1
        c["errors"] += result.status == "error"
        c["timeouts"] += result.status == "timeout"
    return {"turns": t.turns, "obs_tokens": t.obs_tokens, "end": t.end, "calls": len(t.calls),
            "malformed": malformed, "per_tool": per}


def score(worker, items, samples: list[ToolTrajectory]) -> tuple[list[Trajectory], dict[str, float]]:
    """Scores every trajectory's answer (one reward-manager call) and builds the Trajectories."""
    t_cfg = worker.cfg.rollout.tools
    per_sample = [items[s.index] for s in samples]
    views = [SimpleNamespace(text=s.answer_text, response_ids=s.response_ids) for s in samples]
    scores, accs, metrics = worker._rewards(per_sample, views)
    trajs = []
    for item, s, sc, acc in zip(per_sample, samples, scores, accs):
        stats = tool_stats(s)
        penalty = t_cfg.malformed_penalty * stats["malformed"]
        penalty += t_cfg.budget_penalty * (s.end in ("turn_budget", "response_budget"))
        trajs.append(Trajectory(
            uid=item.uid, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
            rollout_logprobs=list(s.logprobs), finish_reason=s.finish_reason, score=float(sc) - penalty,
            acc=bool(acc), data_source=item.data_source, policy_version=worker.policy_version,
            template_mask=list(s.obs_mask), tool_stats=stats, routed_experts=s.routed_experts))
    return trajs, metrics


# ---- metrics ----------------------------------------------------------------------------------
def turn_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """The tool metrics of a batch (module docstring); {} without tool-calling trajectories."""
    tool = [t for t in trajs if t.tool_stats is not None]
    if not tool:
        return {}
    n = len(tool)
    with_call = [t for t in tool if t.tool_stats["calls"] > 0]
    without = [t for t in tool if t.tool_stats["calls"] == 0]
    out = {
        "calls_per_sample": sum(t.tool_stats["calls"] for t in tool) / n,
        "call_rate": len(with_call) / n,
        "turns": sum(t.tool_stats["turns"] for t in tool) / n,
        "obs_tokens": sum(t.tool_stats["obs_tokens"] for t in tool) / n,
        "malformed_per_sample": sum(t.tool_stats["malformed"] for t in tool) / n,
        "accuracy_with_call": sum(t.acc for t in with_call) / max(len(with_call), 1),
        "accuracy_without_call": sum(t.acc for t in without) / max(len(without), 1),
    }
    for end in ("turn_budget", "response_budget", "length"):
        out[f"{end}_frac"] = sum(t.tool_stats["end"] == end for t in tool) / n
    names = sorted({name for t in tool for name in t.tool_stats["per_tool"]})
    for name in names:
        counts = [t.tool_stats["per_tool"].get(name, {}) for t in tool]
        calls = sum(c.get("calls", 0) for c in counts)
        out[f"{name}/calls_per_sample"] = calls / n
        out[f"{name}/error_rate"] = sum(c.get("errors", 0) for c in counts) / max(calls, 1)
        out[f"{name}/timeout_rate"] = sum(c.get("timeouts", 0) for c in counts) / max(calls, 1)
    return out


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    return {f"tools/{k}": v for k, v in turn_stats(trajs).items()}


def eval_metrics(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """<prefix>/tools/call_rate, calls_per_sample, ... of an eval set's trajectories."""
    return {f"{prefix}/tools/{k}": v for k, v in turn_stats(trajs).items()}
