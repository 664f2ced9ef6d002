"""Worker for tests/distributed/test_presets.py: every shipped preset and recipe, scaled down to
the tiny model on 2 gloo ranks (DP=2), runs a few RL steps; plus runs with a custom reward and a
custom advantage estimator named by dotted path. Writes each run's metrics rows."""

import glob
import json
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.parallel.distributed import device
from megarl.rewards import RewardOutput
from megarl.trainer.loop import train
from tests.distributed.harness import finish, metrics_rows, parse_args

REPO = Path(__file__).resolve().parents[2]
CALLS = {"reward": 0, "advantage": 0}


def coin_reward(x, correct_score: float = 1.0) -> RewardOutput:
    """A custom reward (dotted-path plugin): correct for about half the responses, by a hash of
    the text, so that every group has mixed outcomes on an untrained model."""
    CALLS["reward"] += 1
    ok = zlib.crc32(x.response.encode()) % 2 == 0
    return RewardOutput(correct_score if ok else -1.0, ok)


def sign_advantage(inputs, params):
    """A custom advantage estimator (dotted-path plugin): sign of the sequence reward on every token."""
    CALLS["advantage"] += 1
    adv = torch.sign(inputs.token_rewards.sum(-1, keepdim=True)) * inputs.mask
    return adv, adv


def scaled_down(root: Path) -> list[str]:
    """Cluster sizes -> the tiny model and task on 2 CPU ranks."""
    return [
        f"model.hf_path={root / 'model'}", "model.load=null", "model.dtype=fp32", "model.transformer_impl=local",
        "model.sequence_parallel=false", "model.recompute=null", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1",
        "parallel.ep=1", "parallel.etp=null", "parallel.rollout_tp=1", "parallel.nodes=1", "parallel.gpus_per_node=2", "rollout.engine=builtin",
        "rollout.sglang_dp_size=1", "rollout.sglang_ep_size=1", "rollout.sglang_server_args={}",
        f"data.train_path={root / 'task' / 'train.jsonl'}", f"data.eval=[{root / 'task' / 'eval.jsonl'}]",
        "data.prompt_template=arith", "data.apply_chat_template=false", "data.max_prompt_len=32",
        "rollout.n_samples_per_prompt=4",
        "rollout.prompts_per_step=4", "rollout.gen_batch_prompts=8", "rollout.max_new_tokens=12",
        "algorithm.mini_batch_size=8", "algorithm.overlong_max_len=null", "algorithm.overlong_cache_len=4",
        "actor.max_tokens_per_microbatch=64", "critic.max_tokens_per_microbatch=64", "actor.lr=1e-3", "critic.lr=1e-3",
        "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0", "actor.offload_optimizer=false",
        "critic.offload_optimizer=false", "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.resume=false",
        "trainer.tensorboard=false", "eval.n_samples=1", "eval.temperature=0", "eval.max_new_tokens=12",
        "reward.sources={arith: tests.distributed.scripts_presets:coin_reward}",
    ]


def presets() -> dict[str, list[str]]:
    """name -> [config path, extra overrides]."""
    out = {}
    for path in sorted(glob.glob(str(REPO / "configs" / "algorithms" / "*.yaml")) +
                       glob.glob(str(REPO / "configs" / "recipes" / "*" / "*.yaml"))):
        out[os.path.relpath(path, REPO / "configs")] = [path]
    return out


# preset -> overrides its scaled-down run needs besides `scaled_down` (T-PPO: windows below max_new_tokens)
PRESET_EXTRA = {
    "algorithms/tppo.yaml": ["rollout.window_tokens=4"],
    # PAG: short instructions, micro-batches that hold all turns (32 + 3 x 12 + the instructions)
    "algorithms/pag.yaml": ['algorithm.pag.verify_instruction="\\nV\\n"', 'algorithm.pag.revise_instruction="\\nR\\n"',
                            "actor.max_tokens_per_microbatch=128", "critic.max_tokens_per_microbatch=128"],
    # the code PRM's labelling and dense rewards need a code task and a trained PRM: tests/distributed/test_prm.py
    "algorithms/code_prm.yaml": ["prm.dense_reward=false", "prm.init_critic=false"],
    # ReTool: the response budget (turns and interpreter outputs) of the tiny run, not the paper's 16384
    "algorithms/retool.yaml": ["rollout.tools.max_response_tokens=null"],
}


# sigmoid-routed MoE families (configs/models/*.json model_type) -> the tiny model of their family
SIGMOID_MOE_MODELS = {"deepseek_v3": "deepseek_model", "kimi_k2": "deepseek_model", "glm4_moe": "glm_model"}
HYBRID_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # -> root/hybrid_model (a tiny qwen3_next)


def moe_extra(config: str, root: Path) -> list[str]:
    """A recipe of an MoE model (configs/models/<model.name>.json has experts, in its text_config
    for a vision-language model) runs on the tiny Qwen3-MoE (root/moe_model), a DeepSeek-V3 / Kimi-K2
    / GLM-4.5 recipe on the tiny model of its family, with the experts split over the 2 ranks (EP=2)."""
    name = load_config(config).model.name
    path = REPO / "configs" / "models" / f"{name}.json"
    hf = json.loads(path.read_text()) if name and path.exists() else {}
    if hf.get("model_type") in SIGMOID_MOE_MODELS:
        return [f"model.hf_path={root / SIGMOID_MOE_MODELS[hf['model_type']]}", "parallel.ep=2"]
    if hf.get("model_type") in HYBRID_MODELS:  # gated delta-net layers: the tiny Qwen3-Next
        return [f"model.hf_path={root / 'hybrid_model'}", "parallel.ep=2"]
    if not (hf.get("num_experts") or (hf.get("text_config") or {}).get("num_experts")):
        return []
    return [f"model.hf_path={root / 'moe_model'}", "parallel.ep=2"]

# run name -> overrides: every policy loss and advantage estimator of megarl/algorithms/objectives.py
OBJECTIVE_RUNS = {
    "gspo": ["algorithm.policy_loss=gspo"],
    "gspo_token+remax": ["algorithm.policy_loss=gspo_token", "algorithm.advantage=remax"],
    "cispo+opo": ["algorithm.policy_loss=cispo", "algorithm.advantage=opo"],
    "sapo": ["algorithm.policy_loss=sapo"],
    "clip_cov": ["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_ratio=0.1"],
    "kl_cov": ["algorithm.policy_loss=kl_cov", "algorithm.kl_cov_ratio=0.1"],
    "gmpo": ["algorithm.policy_loss=gmpo"],
    "gpg+gpg": ["algorithm.policy_loss=gpg", "algorithm.advantage=gpg"],
}


def run(name: str, config: str, overrides: list[str], root: Path) -> list[dict]:
    run_dir = root / "runs" / name.replace("/", "_")
    cfg = load_config(config, overrides + [f"trainer.run_dir={run_dir}"])
    steps = 2 + min(cfg.algorithm.value_pretrain_steps, 1)
    cfg = load_config(config, overrides + [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
                                           f"algorithm.value_pretrain_steps={min(cfg.algorithm.value_pretrain_steps, 1)}"])
    train(cfg)
    dist.barrier()
    return metrics_rows(run_dir)


def main():
    a = parse_args()
    root = a.root
    base = scaled_down(root)
    res = {}
    for name, (config,) in presets().items():
        res[name] = {"rows": run(name, config, base + PRESET_EXTRA.get(name, []) + moe_extra(config, root), root),
                     "algorithm": load_config(config).algorithm.name}
    res["custom_advantage"] = {"rows": run("custom_advantage", str(REPO / "configs/algorithms/grpo.yaml"),
                                           base + ["algorithm.advantage=tests.distributed.scripts_presets:sign_advantage",
                                                   "algorithm.kl_coef=0.0"], root), "algorithm": "custom"}
    for name, extra in OBJECTIVE_RUNS.items():  # megarl/algorithms/objectives.py on the grpo preset
        res[f"objective/{name}"] = {"rows": run(f"objective_{name}", str(REPO / "configs/algorithms/grpo.yaml"),
                                                base + ["algorithm.kl_coef=0.0", *extra], root),
                                    "algorithm": "objective"}
    from tests.distributed import scripts_presets as plugins  # the module the dotted paths imported

    calls = torch.tensor([plugins.CALLS["reward"], plugins.CALLS["advantage"]], dtype=torch.float64, device=device())
    dist.all_reduce(calls)
    res["calls"] = {"reward": calls[0].item(), "advantage": calls[1].item()}
    finish(a.out, res)


if __name__ == "__main__":
    main()
