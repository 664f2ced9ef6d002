"""Worker for tests/distributed/test_tools.py (2 gloo ranks, TP=2, strict device mode, the ReTool
preset switched to chat-template tool calls).

The tiny model (512-token context, tests/unit/chat_templates.py TINY_TOOLS as its chat template)
gets a short SFT on one fixed behaviour per prompt kind (`KINDS`), so that its sampled
trajectories take each path of the tool loop: a user tool given by dotted path
(tests.unit.tool_fixtures:add), the interpreter, a tool that raises, one that times out, a
malformed call, and calls until the turn budget. Then:

1. components: the trainer's own components collect one step of tool rollouts (builtin engine
   after a weight stream from the TP=2 actor); the actor recomputes their log-probs, the critic
   their values, and the advantages are computed -> per trajectory the response ids, observation /
   loss / value masks, advantages, returns, engine and trainer log-probs, tool stats; the rollout
   metrics; the user tool's recorded calls.
2. loop: `megarl.trainer.loop.train` runs 2 steps (critic, reference model with a KL loss, an
   entropy bonus) -> the metrics.jsonl rows.
"""

import json
from pathlib import Path

import torch

from megarl.parallel.distributed import init_distributed
from tests.distributed.harness import finish, gather, metrics_rows, on_rank0, parse_args


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# kind -> (problem, answer, [turn texts]; a turn after the first follows its predecessor's tool response)
KINDS = {
    "add": ("add 3 4", "7", [call("add", {"a": 3, "b": 4}), "Answer: 7"]),
    "python": ("py 6 7", "42", [call("python", {"code": "print(6*7)"}), "Answer: 42"]),
    "boom": ("boom", "0", [call("boom", {}), "Answer: 0"]),
    "slow": ("slow", "0", [call("slow", {"seconds": 30}), "Answer: 0"]),
    "malformed": ("bad", "0", ['<tool_call>\n{"name": add, 3}\n</tool_call>', "Answer: 0"]),
    "loop": ("loop", "1", [call("python", {"code": "print(1)"})] * 3),
}
RESULTS = {"add": "7", "python": "42", "boom": "Error: RuntimeError: the tool crashed",
           "slow": "Error: slow timed out after 6 s", "malformed": "Error: x", "loop": "1"}


def write_files(root: Path, cfg) -> None:
    from megarl.data.templates import render_prompt
    from megarl.rollout.tool_calls import ChatJsonFormat, ToolResult
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model
    from megarl.trainer.tools import tool_schemas
    from tests.unit.chat_templates import TINY_TOOLS, byte_tokenizer_with

    tok = byte_tokenizer_with(TINY_TOOLS)
    save_tiny_model(root / "model", TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                                                  max_position_embeddings=512, seed=0), tokenizer=tok)
    schemas = tool_schemas(cfg)
    fmt = ChatJsonFormat(tok, schemas)
    RESULTS["malformed"] = f"Error: {fmt.parse(KINDS['malformed'][2][0])[0].error}"  # what the loop answers
    sft, train = [], []
    for kind, (problem, answer, turns) in KINDS.items():
        train.append({"problem": problem, "answer": answer, "data_source": "arith"})
        text = tok.decode(render_prompt(problem, "raw", tok, True, schemas))
        for k, turn in enumerate(turns):
            sft += [{"prompt": text, "response": turn}] * (2 if kind == "loop" else 1)  # its 3 turns: the hardest path
            obs = fmt.observation([ToolResult(kind, RESULTS[kind])], turn + tok.eos_token)
            text += turn + tok.eos_token + obs
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft * 8))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train * 8))


def case_components(cfg) -> dict:
    from megarl.trainer import rl
    from megarl.trainer.rows import RowTable
    from megarl.trainer.components import build_components
    from megarl.trainer.step_collector import step_collector
    from megarl.trainer.state import TrainerState
    from tests.unit import tool_fixtures

    run = build_components(cfg)
    run.start_engine()
    run.sync_weights(0)
    with run.generation(release=True):
        rows, metrics = step_collector(cfg, run)(0, TrainerState())
    local, here, _ = run.take_rows(rows, 0, TrainerState())  # this DP rank's rows, as the loop gets them
    rl.set_masks(local, cfg)
    local.old_logprobs = rl.compute_log_probs(run.actor, local, cfg.rollout.temperature)
    local.ref_logprobs = rl.compute_log_probs(run.ref, local, cfg.rollout.temperature)
    local.values = rl.compute_values(run.critic, local)
    rl.compute_advantages(RowTable.of(rows), local, here, cfg, run.dp_group, 0.0)
    out = {"metrics": metrics, "mismatch": rl.logprob_mismatch(local, run.dp_group), "trajectories": [],
           "user_tool_calls": [c for calls in gather(tool_fixtures.CALLS) for c in calls]}
    tok = run.worker.tokenizer
    for i, r in enumerate(here):  # local row i is row r of the step
        n = len(local.response_ids[i])
        out["trajectories"].append({
            "text": tok.decode(local.response_ids[i]), "prompt": tok.decode(local.prompt_ids[i]),
            "response_ids": local.response_ids[i], "obs_mask": local.template_mask[i, :n].int().tolist(),
            "tool_stats": rows[r].tool_stats, "acc": bool(local.acc[i]), "score": float(local.score[i]),
            "engine_logprobs": local.rollout_logprobs[i, :n].tolist(), "trainer_logprobs": local.old_logprobs[i, :n].tolist(),
            "loss_mask": local.loss_mask[i, :n].tolist(), "value_mask": local.value_mask[i, :n].tolist(),
            "advantages": local.advantages[i, :n].tolist(), "returns": local.returns[i, :n].tolist(),
        })
    return out


def main():
    a = parse_args(config=True)
    root, cfg = a.root, a.cfg
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    on_rank0(write_files, root, cfg)

    from megarl.trainer.loop import train
    from megarl.trainer.sft import sft

    cfg.model.load = sft(cfg, save_to=str(root / "sft_actor"))["checkpoint"]
    res = {"components": case_components(cfg)}
    cfg.trainer.run_dir = str(root / "loop")
    train(cfg)
    res["loop"] = metrics_rows(root / "loop")
    finish(a.out, res)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
