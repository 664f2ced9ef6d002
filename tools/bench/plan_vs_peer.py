"""The planner's step time against a peer's published measurements: NeMo-RL v0.4's GRPO
performance table (docs/about/performance-summary.md of NVIDIA-NeMo/RL, DGX-H100, on-policy, bf16
training and generation, Megatron-core training, vLLM generation).

    python -m tools.bench.plan_vs_peer            # the three on-policy Qwen3 rows
    python -m tools.bench.plan_vs_peer --decode-eff 0.3 --mfu 0.25

Each row sets megarl's recipe to the published run: generation batch G-GBS samples (prompts x 16
samples), training batch T-GBS (one optimizer step per mini-batch of T-GBS), maximum sequence
length T-Max, mean sequence G-Average (a mean prompt of 200 tokens is assumed: OpenMathInstruct-2
problems are short; the rest is response), the generation TP (G-TP) and the training TP / CP / EP /
PP, on H100s. NeMo-RL serves with vLLM (megarl's planner models SGLang: TP engines with no
attention DP here), runs the policy's log-probs and the refit inside the measured step, and
reports the step end to end; the planner's step is rollout + training (old log-probs included) +
host copies. Qwen3-32B has no config in configs/models: its hub values are given here.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.plan_vs_peer`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import os
import tempfile

from megarl.config import load_config
from megarl.planner import GPUS, load_arch, plan

QWEN3_32B = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": False}

# (name, model, published step s, GPUs, G-GBS, T-GBS, T-max, G-average, G-TP, train TP, CP, EP, PP)
PUBLISHED = [
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", 225.0, 32, 2048, 512, 4096, 3154, 4, 2, 1, 8, 1),
    ("Qwen3-235B-A22B", "qwen3-235b-a22b", 506.0, 128, 512, 512, 8192, 5671, 16, 2, 2, 16, 8),
    ("Qwen3-32B", None, 393.0, 32, 2048, 512, 4096, 3206, 4, 4, 1, 1, 4),
]
PROMPT = 200


def planned(row: tuple, mfu: float, decode_eff: float, model_json: str) -> dict:
    name, model, _, gpus, g_gbs, t_gbs, t_max, g_avg, g_tp, tp, cp, ep, pp = row
    overrides = [
        f"model.name={model}" if model else "model.name=qwen3-32b", "rollout.engine=sglang",
        f"parallel.nodes={gpus // 8}", "parallel.gpus_per_node=8", f"parallel.tp={tp}", f"parallel.cp={cp}",
        f"parallel.ep={ep}", f"parallel.pp={pp}", f"parallel.rollout_tp={g_tp}", "parallel.etp=1" if ep > 1 else "parallel.etp=null",
        f"model.sequence_parallel={str(tp > 1).lower()}", "model.recompute=full",
        f"rollout.prompts_per_step={g_gbs // 16}", "rollout.n_samples_per_prompt=16", "rollout.gen_batch_prompts=null",
        f"data.max_prompt_len={PROMPT}", f"rollout.max_new_tokens={t_max - PROMPT}",
        f"algorithm.mini_batch_size={t_gbs}", f"actor.max_tokens_per_microbatch={t_max}",
        "rollout.mem_fraction=0.6", "rollout.offload_train_state=true",
    ]
    cfg = load_config(os.path.join("configs", "algorithms", "grpo.yaml"), overrides)
    arch, hf, _ = load_arch(cfg, None if model else model_json)
    pl = plan(cfg, arch, hf, GPUS["h100"], avg_prompt_len=PROMPT, avg_response_len=g_avg - PROMPT, mfu=mfu,
              decode_eff=decode_eff)
    return pl.time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--decode-eff", type=float, default=0.6)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_json = os.path.join(tmp, "config.json")
        with open(model_json, "w") as f:
            json.dump(QWEN3_32B, f)
        print(f"planner (MFU {args.mfu}, decode efficiency {args.decode_eff}) against NeMo-RL v0.4 on-policy GRPO, H100")
        print("| model | GPUs | samples x mean tokens | NeMo-RL step | planned rollout | planned train | planned step "
              "| planned / published |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in PUBLISHED:
            t = planned(row, args.mfu, args.decode_eff, model_json)
            print(f"| {row[0]} | {row[3]} | {row[4]:,} x {row[7]:,} | {row[2]:.0f} s | {t['rollout_s']:.0f} s | "
                  f"{t['train_s']:.0f} s | {t['step_s']:.0f} s | {t['step_s'] / row[2]:.2f} |")


if __name__ == "__main__":
    main()
