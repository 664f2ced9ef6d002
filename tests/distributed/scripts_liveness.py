"""Worker for tests/unit/test_config_liveness.py: every config field changes the run.

For each leaf field of the config schema, WITNESSES gives a changed value and an observation: a
function of the config that calls the code consuming that field (the model build, the loss,
the advantages, the data loader, the RL loop, ...). The worker evaluates the observation on a
small base config and on the base with that one field changed, in one process (world size 1,
gloo, the CPU runtime), and writes both. A field is live when the observations differ once
identity (run-directory names, paths, times: `normalise`) is taken out of them. An
error is an observation too (a setting that cannot run here must fail clearly, not silently).
NOT_ON_CPU lists fields whose effect needs a GPU, TE or SGLang; SHOWN_ELSEWHERE names the test
that shows a field live where a two-run comparison here would only repeat it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

NOT_ON_CPU = {
    "rollout.mem_fraction": "SGLang's mem_fraction_static (passed by build_engine to the SGLang engine; no SGLang on CPU)",
}
SHOWN_ELSEWHERE = {
    "model.moe_aux_loss_coeff": "tests/distributed/test_moe_train.py::test_load_balancing_loss_is_configurable "
                                "(MoE only: the liveness model here is dense)",
    "model.moe_load_balancing_type": "tests/distributed/test_moe_train.py::test_load_balancing_loss_is_configurable",
    "model.freeze_router": "tests/distributed/test_moe_train.py::test_frozen_router_stays_bit_identical_while_experts_train",
    "model.moe_expert_bias_update_rate": "tests/distributed/test_deepseek_train.py::test_bias_update_rate_moves_the_bias "
                                         "(sigmoid-routed MoE only: the liveness model here is dense)",
    "model.freeze_vision": "tests/distributed/test_vlm_train.py::test_freeze_vision (vision-language models only: "
                           "the liveness model here is a text model)",
    **{f"data.{k}": "tests/unit/test_data_images.py::test_config_fields_reach_the_data_path (rows with images need a "
                    "vision-language model; the liveness model here is a text model)"
       for k in ("image_key", "image_placeholder", "max_image_tokens")},
    **{f"data.{k}": "tests/unit/test_data_video.py::test_config_fields_reach_the_data_path (rows with videos need a "
                    "vision-language model; the liveness model here is a text model)"
       for k in ("video_key", "video_placeholder", "max_video_tokens")},
    "algorithm.routing_replay": "tests/distributed/test_moe_train.py::test_rl_step_logs_routing_agreement (an RL step "
                                "with replay logs moe/replayed_fraction; test_replay_makes_the_trainer_route_like_the_engine)",
    "model.logprob_chunk_tokens": "tests/distributed/test_cp.py::test_chunked_views_equal_unchunked_and_the_formulas "
                                  "(the chunk size changes memory, not results: the test shows chunks of 1, 3 and "
                                  "4096 tokens give the same log-probs, entropy and gradients); "
                                  "tools/bench/long_context.py measures the memory",
    "algorithm.gpg_alpha": "tests/unit/test_algorithms_objectives.py::test_gpg_alpha_field_is_live_in_the_trainer "
                           "(alpha differs from 1 only with an all-equal group, which the fixed batch here lacks)",
    "trainer.resume": "tests/distributed/test_trainer.py::test_resume_matches_uninterrupted_run",
    "parallel.collective_timeout_s": "tests/distributed/test_lost_rank.py::"
                                     "test_a_lost_rank_ends_the_other_within_the_timeout_naming_the_phase",
    "quickstart.critic_sft_steps": "tests/distributed/test_critic_learns.py::test_critic_backbone_from_a_policy_checkpoint "
                                   "(the quickstart continues the policy's SFT for this many steps and sets critic.init_from "
                                   "to that checkpoint; README 'The critic on the quickstart' measures its effect)",
    "algorithm.pag.enable": "tests/unit/test_pag_trainer.py::test_worker_generates_multi_turn_trajectories_when_enabled "
                            "(and tests/distributed/test_pag.py: the RL loop with PAG at TP=2)",
    "algorithm.pag.max_policy_turns": "tests/unit/test_pag_trainer.py::test_worker_generates_multi_turn_trajectories_when_enabled "
                                      "(max_policy_turns=1: the first attempt only)",
    "algorithm.pag.alpha": "tests/unit/test_pag_trainer.py::test_score_checks_every_policy_turn_and_sums_the_turn_rewards",
    "algorithm.pag.answer_tail_chars": "tests/unit/test_pag_trainer.py::test_score_checks_every_policy_turn_and_sums_the_turn_rewards",
    **{f"algorithm.pag.{k}": "tests/unit/test_pag_trainer.py::test_instructions_come_from_the_config (the appended ids) "
                             "and test_worker_generates_multi_turn_trajectories_when_enabled"
       for k in ("verify_instruction", "revise_instruction")},
    **{f"algorithm.pag.{k}": "tests/unit/test_pag_trainer.py::test_turn_independent_and_role_adv_norm_switches"
       for k in ("turn_independent", "role_adv_norm")},
    **{f"prm.{k}": "tests/distributed/test_prm.py::test_labels_come_from_binary_searches_with_k_completions_per_prefix "
                   "(labelling needs a policy that writes lines: a short SFT first; counts follow these fields)"
       for k in ("label_k", "label_prompts", "label_samples")},
    **{f"prm.{k}": "tests/distributed/test_prm.py::test_prm_fits_its_labels (PRM training after labelling)"
       for k in ("train_steps", "batch_size")},
    **{f"prm.{k}": "tests/distributed/test_prm.py::test_critic_initialised_from_the_prm_starts_with_its_values"
       for k in ("path", "init_critic")},
    **{f"prm.{k}": "tests/distributed/test_prm.py::test_dense_rewards_sit_on_line_ends_with_lambda_over_n_lines "
                   "(and tests/unit/test_prm.py::test_token_rewards_add_dense_line_rewards_to_the_eos_outcome)"
       for k in ("dense_reward", "lambda_fail", "lambda_pass")},
    "algorithm.name": "tests/unit/test_config_recipes.py::test_every_preset_and_recipe_loads (a label, written to "
                      "run_dir/config.yaml; each preset's name is its file's)",
    **{f"data.{k}": "tests/unit/test_data_selection.py::test_build_data_schedules_by_the_data_first_sources_fields "
                    "(needs a training set with two data sources; this one has one)"
       for k in ("first_sources", "first_sources_steps", "first_sources_decay")},
    # metrics loggers (docs/ecosystem.md): the W&B / MLflow runs are read back with their own readers there
    **{f"trainer.{k}": "tests/unit/test_loggers.py::test_wandb_and_mlflow_hold_config_tags_metrics_and_resume_the_same_run "
                       "(which backends write, the project / experiment and the tags of the runs read back)"
       for k in ("loggers", "project", "tags")},
    **{f"trainer.{k}": "tests/unit/test_loggers.py::test_run_name_and_wandb_entity_reach_the_runs"
       for k in ("run_name", "wandb_entity")},
    "trainer.wandb_mode": "tests/unit/test_loggers.py::test_unreachable_servers_are_start_up_errors (online needs the "
                          "server; every other logger test runs offline: no network here)",
    "trainer.mlflow_tracking_uri": "tests/unit/test_loggers.py::test_sft_logs_to_a_run_of_its_own (the run lands in "
                                   "the store the field names)",
    # tool-calling rollouts (docs/tools.md): a trajectory needs a policy that writes tool calls (scripted there)
    "rollout.tools.enable": "tests/unit/test_tool_trainer.py::test_rollout_fields_change_the_trajectories "
                            "(and tests/distributed/test_tools.py: the RL loop with tool calls at TP=2)",
    **{f"rollout.tools.{k}": "tests/unit/test_tool_trainer.py::test_rollout_fields_change_the_trajectories"
       for k in ("max_turns", "max_response_tokens", "keep_state")},
    **{f"rollout.tools.{k}": "tests/unit/test_tool_trainer.py::test_toolbox_follows_the_config (the interpreter's "
                             "limits, the pool, the observation cap; tests/unit/test_tool_runtime.py: their effects)"
       for k in ("timeout_s", "memory_mb", "max_workers", "max_output_chars", "python")},
    **{f"rollout.tools.{k}": "tests/unit/test_tool_trainer.py::test_chat_json_declares_the_tools_in_the_prompt "
                             "(and tests/distributed/test_tools.py: a user tool called with the parsed arguments)"
       for k in ("format", "functions")},
    **{f"rollout.tools.{k}": "tests/unit/test_tool_trainer.py::test_penalties_for_malformed_calls_and_the_turn_budget"
       for k in ("malformed_penalty", "budget_penalty")},
}


# --------------------------------------------------------------------------- observations
class Ctx:
    """Files and objects shared by the observations (built once)."""

    def __init__(self, root: Path):
        from megarl.tasks.arith import write_task_files
        from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

        self.root = root
        self.model = root / "model"
        save_tiny_model(self.model, TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=0))
        save_tiny_model(root / "model_b", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=1))
        save_tiny_model(root / "model_c", TinyModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, seed=2))
        self.task = write_task_files(root / "task", n_sft=12, n_train=24, n_eval=2, seed=0)
        rows = [{"problem": f"{i} + {i} =", "alt_problem": f"{i} plus {i} =", "answer": str(2 * i),
                 "alt_answer": str(2 * i + 1), "reference": f"ref {i}", "alt_reference": f"alt {i}",
                 "data_source": "arith", "alt_source": "math"} for i in range(12)]
        self.data = root / "prompts.jsonl"
        self.data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.sft = root / "sft.jsonl"
        self.sft.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "response": "x" * (i * 8)}) + "\n"
                                    for i in range(12)))
        self.cache: dict = {}


def base_overrides(ctx: Ctx) -> list[str]:
    return [
        f"model.hf_path={ctx.model}", "model.dtype=fp32", "model.transformer_impl=local",
        f"data.train_path={ctx.data}", f"data.eval=[{ctx.task['eval']}]", "data.prompt_template=arith",
        "data.max_prompt_len=32", "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=8", "rollout.weight_bucket_mb=1", "algorithm.mini_batch_size=8",
        "algorithm.overlong_cache_len=4", "actor.max_tokens_per_microbatch=64", "critic.max_tokens_per_microbatch=64",
        "critic.enable=true", "actor.lr=1e-3", "critic.lr=1e-3", "reward.sources={arith: math}",
        "trainer.total_steps=2", "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.keep_last=null",
        "trainer.tensorboard=false", "eval.n_samples=1", "eval.temperature=0", "eval.max_new_tokens=8",
        f"sft.data_path={ctx.sft}", "sft.max_len=64", "sft.batch_size=4",
    ]


def _err(e: BaseException) -> str:
    return f"error {type(e).__name__}: {str(e)[:200]}"


def _round(t: torch.Tensor) -> list:
    return [round(float(x), 5) for x in t.reshape(-1)]


def fixed_batch(cfg, seed: int = 0):
    from megarl.trainer.batch import StepBatch, Trajectory

    rng = random.Random(seed)
    trajs = []
    for i in range(8):
        r = [rng.randrange(3, 60) for _ in range(rng.randint(3, 7))]
        trajs.append(Trajectory(uid=str(i // 2), prompt_ids=[rng.randrange(3, 60) for _ in range(5)], response_ids=r,
                                rollout_logprobs=[-1.0] * len(r), finish_reason=["stop", "length", "truncated"][i % 3],
                                score=float(i % 2) - 0.5, acc=bool(i % 2)))
    batch = StepBatch.from_trajectories(trajs)
    g = torch.Generator().manual_seed(seed)
    batch.old_logprobs = -torch.rand(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.ref_logprobs = -torch.rand(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.values = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def obs_model_options(ctx, cfg):
    from megarl.trainer.build import model_options

    return repr(sorted(model_options(cfg.model, cfg.parallel).items()))


def obs_impl(ctx, cfg):
    from megarl.trainer.build import resolve_impl

    return resolve_impl(cfg.model)


def obs_planner(ctx, cfg):
    from megarl import planner as plan

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=None))
    return repr(plan.load_arch(cfg)[0])


def obs_parallel(ctx, cfg):
    from megarl.parallel.distributed import _sizes

    return repr(_sizes(cfg.parallel))


def obs_world(ctx, cfg):
    from megarl.config.validate import expected_world_size

    return expected_world_size(cfg)


def obs_engine_group(ctx, cfg):
    from megarl.trainer.build import engine_group

    try:
        return repr(engine_group(cfg.parallel.rollout_tp))
    except ValueError as e:
        return _err(e)


def _hf(ctx, cfg):
    from megarl.trainer.build import load_hf_config_and_tokenizer

    return load_hf_config_and_tokenizer(cfg.model.hf_path)


def obs_hf(ctx, cfg):
    return _hf(ctx, cfg)[0].hidden_size


def _params_sum(model) -> float:
    return round(sum(float(p.detach().double().sum()) for p in model.modules[0].parameters()), 4)


def obs_actor(ctx, cfg):
    """The actor as built from the config: weights, dtype, optimizer settings, micro-batching,
    the LR schedule over 6 steps."""
    from megarl.trainer import build

    hf, _ = _hf(ctx, cfg)
    try:
        actor = build.build_actor(cfg, hf)
    except (ValueError, RuntimeError) as e:
        return _err(e)
    return _model_obs(actor, cfg)


def obs_attention_kernel(ctx, cfg):
    """The kernel megarl's local attention runs on the built actor's rows (fp32, host)."""
    import torch

    from megarl.models.attention_kernels import select_kernel
    from megarl.trainer import build

    hf, _ = _hf(ctx, cfg)
    build.build_actor(cfg, hf)
    return select_kernel("cpu", torch.float32, cfg.parallel.cp)


def _model_obs(model, cfg):
    oc = model.optimizer.config
    batch = fixed_batch(cfg)
    mbs = model.microbatches(batch)
    return {"params": _params_sum(model), "dtype": str(next(model.modules[0].parameters()).dtype),
            "optim": [oc.weight_decay, oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.clip_grad,
                      oc.use_distributed_optimizer, oc.bf16],
            "microbatches": [(tuple(m.input_ids.shape), len(m.rows)) for m in mbs],
            "lr": [round(model.set_lr(s), 8) for s in range(6)]}


def obs_critic(ctx, cfg):
    from megarl.trainer import build

    hf, _ = _hf(ctx, cfg)
    try:
        actor = ctx.cache.setdefault("actor", build.build_actor(_base(ctx), hf))
        critic = build.build_critic(cfg, hf, actor)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        return _err(e)
    return _model_obs(critic, cfg)


def obs_components(ctx, cfg):
    from megarl.trainer.components import build_components

    run = build_components(cfg)
    return {"critic": run.critic is not None, "ref": run.ref is not None}


def obs_data(ctx, cfg):
    from megarl.trainer import build

    try:
        data = build.build_data(cfg, _hf(ctx, cfg)[1])
    except (ValueError, FileNotFoundError, KeyError) as e:
        return _err(e)
    items = data.train.dataset
    first = data.train.next_batch()
    return {"n": len(items), "prompt": items[0].prompt_ids, "answer": items[0].answer, "ref": items[0].reference,
            "source": items[0].data_source, "evals": [(e.name, len(e.items)) for e in data.evals],
            "first_batch": [it.uid for it in first]}


def obs_engine(ctx, cfg):
    from megarl.trainer import build

    hf, tok = _hf(ctx, cfg)
    try:
        return type(build.build_engine(cfg, hf, tok)).__name__
    except (ImportError, ValueError, RuntimeError) as e:
        return _err(e)


def obs_sglang_server_args(ctx, cfg):
    from megarl.rollout.sglang.requests import server_args

    return server_args(cfg)


def obs_rollout_kv_cache(ctx, cfg):
    """The builtin engine as build_engine makes it, generating through the RolloutWorker: the KV
    cache it reports (rollout/kv_cache_gb), or the budget's refusal."""
    from transformers import AutoModelForCausalLM

    from megarl.data.dataset import PromptItem
    from megarl.trainer import build
    from megarl.trainer.generation import RolloutWorker, sampling_from_config

    hf, tok = _hf(ctx, cfg)
    engine = build.build_engine(cfg, hf, tok)
    engine.update_weights([list(AutoModelForCausalLM.from_pretrained(cfg.model.hf_path).state_dict().items())])
    worker = RolloutWorker(engine, tok, build.build_rewards(cfg), cfg)
    items = [PromptItem(uid=f"u{i}", prompt=f"{i} + {i} =", answer=str(2 * i), data_source="arith") for i in range(2)]
    try:
        worker.generate(items, [tok.encode(it.prompt) for it in items], sampling_from_config(cfg.rollout, seed=0))
    except ValueError as e:
        return _err(e)
    return worker.metrics["rollout/kv_cache_gb"]


def obs_sampling(ctx, cfg):
    from megarl.trainer.generation import sampling_from_config

    return repr(sampling_from_config(cfg.rollout, seed=0))


class ScriptedWorker:
    """Groups with fixed numbers of correct samples (the engine itself is tested elsewhere)."""

    def __init__(self):
        self.metrics = {}

    def generate(self, items, encoded, sampling):
        from megarl.trainer.batch import Trajectory

        out = []
        for uid in items:
            for k in range(sampling.n):
                ok = k < int(uid[1:]) % (sampling.n + 1)
                out.append(Trajectory(uid, [1], [2], [0.0], "stop", score=float(ok), acc=ok))
        self.metrics = {"reward/count": float(len(out))}
        return out


def obs_collect(ctx, cfg):
    from megarl.trainer.step_collector import collect_step_batch

    stream = iter(f"p{i}" for i in range(10_000))
    buffer: list = []
    try:
        batch, m = collect_step_batch(lambda n: [next(stream) for _ in range(n)], lambda items: [[0]] * len(items),
                                      ScriptedWorker(), cfg, 0, buffer)
    except RuntimeError as e:
        return _err(e)
    return {"uids": [t.uid for t in batch], "rounds": m["rollout/rounds"], "carried": [g[0].uid for g in buffer]}


def obs_collect_function(ctx, cfg):
    from megarl.trainer.step_collector import collect_function

    return collect_function(cfg).__qualname__


def obs_score(ctx, cfg):
    from megarl.data.dataset import PromptItem
    from megarl.rollout import Sample
    from megarl.trainer.build import build_rewards
    from megarl.trainer.generation import RolloutWorker

    _, tok = _hf(ctx, cfg)
    worker = RolloutWorker(None, tok, build_rewards(cfg), cfg)
    items = [PromptItem("a", "1 + 1 =", "2", "arith")]
    samples = [Sample([1], [5] * n, [0.0] * n, "stop", text=text) for n, text in
               [(2, "Answer: 2"), (7, "Answer: 2"), (8, "Answer: 3")]]
    trajs, _ = worker._score(items, samples)
    return [round(t.score, 4) for t in trajs]


def obs_masks(ctx, cfg):
    from megarl.trainer import rl

    batch = fixed_batch(cfg)
    rl.set_masks(batch, cfg)
    return [_round(batch.loss_mask.sum(-1)), _round(batch.value_mask.sum(-1))]


def obs_window_masks(ctx, cfg):
    """T-PPO token filtering of a batch with carried samples (window_start > 0)."""
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch, Trajectory

    batch = StepBatch.from_trajectories([Trajectory(str(i), [5, 6], [7] * 6, [-1.0] * 6, ["truncated", "stop"][i % 2],
                                                    window_start=2 * i % 5) for i in range(4)])
    rl.set_masks(batch, cfg)
    return [_round(batch.loss_mask.sum(-1)), _round(batch.value_mask.sum(-1))]


def obs_rollout_is(ctx, cfg):
    """The off-policy correction of the fixed batch (rollout log-probs -1, old log-probs in (-1, 0]):
    advantages, loss mask, metrics."""
    from megarl.trainer import rl

    batch = fixed_batch(cfg)
    rl.set_masks(batch, cfg)
    metrics = rl.rollout_correction(batch, cfg, None)
    rl.compute_advantages(batch, batch, list(range(len(batch))), cfg, None, 0.0)
    return {"adv": _round(batch.advantages), "mask": _round(batch.loss_mask.sum(-1)),
            "m": {k: round(v, 6) for k, v in sorted(metrics.items())}}


def obs_windows(ctx, cfg):
    """One T-PPO rollout step (policy version 3) with carried samples whose first windows came
    from versions 0, 1, 2: how many continue, restart, drop, and the new samples."""
    from megarl.trainer.batch import Trajectory
    from megarl.trainer.rows import gather_metas
    from megarl.trainer.state import TrainerState
    from megarl.trainer.windows import SuccessiveBatching

    run = _run_components(ctx, cfg)
    run.sync_weights(3)
    items = run.data.train.dataset
    carried = [Trajectory(items[i].uid, list(items[i].prompt_ids), [7, 8], [-1.0, -1.0], "truncated",
                          policy_version=2, start_version=i) for i in range(3)]
    state = TrainerState(in_flight=gather_metas(run.worker.store, carried, 0))  # payloads where they were made
    _, m = SuccessiveBatching(cfg, run.worker, run.next_items, run.data.encode, items)(3, state)
    return {k: m[k] for k in ("rollout/continued_samples", "rollout/restarted_samples", "rollout/dropped_samples",
                              "rollout/new_samples")}


def obs_advantages(ctx, cfg):
    from megarl.trainer import rl

    batch = fixed_batch(cfg)
    rl.set_masks(batch, cfg)
    local = batch.select(list(range(len(batch))))
    kl = rl.kl_controller(cfg)
    metrics = rl.compute_advantages(batch, local, list(range(len(batch))), cfg, None, kl.value,
                                     rl.value_pretraining(cfg, 0))
    return {"adv": _round(local.advantages), "ret": _round(local.returns), "m": sorted(metrics)}


def obs_kl_controller(ctx, cfg):
    from megarl.trainer import rl

    kl = rl.kl_controller(cfg)
    kl.update(0.5, 1000)
    return round(kl.value, 8)


def _microbatch(cfg):
    from megarl.parallel.distributed import device
    from megarl.trainer import rl
    from megarl.trainer.batch import build_microbatch

    batch = fixed_batch(cfg)
    rl.set_masks(batch, cfg)
    g = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    mb = build_microbatch(batch, list(range(len(batch)))).to(device())
    out = torch.randn(*mb.input_ids.shape, 61, generator=g).to(device()).requires_grad_()
    return batch, mb, out


def obs_actor_loss(ctx, cfg):
    from megarl.trainer import rl

    batch, mb, logits = _microbatch(cfg)
    with torch.no_grad():  # old log-probs near the current ones: ratios around 1, some clipped each way
        per_position = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        logp = per_position.reshape(-1)[mb.resp_index] * mb.data.response_mask
        mb.data.old_logprobs = logp + 0.4 * torch.sin(torch.arange(logp.numel(), device=logp.device).reshape(logp.shape))
    counts = rl.global_counts(batch, list(range(len(batch))), None, batch.loss_mask)
    loss, logs = rl.actor_loss_fn(cfg, counts, cfg.rollout.temperature)(mb, logits)
    loss.backward()
    return {"loss": round(float(loss), 6), "grad": round(float(logits.grad.abs().sum()), 5),
            "logs": {k: round(float(v), 6) for k, v in sorted(logs.items())}}


def obs_critic_loss(ctx, cfg):
    from megarl.trainer import rl

    batch, mb, out = _microbatch(cfg)
    counts = rl.global_counts(batch, list(range(len(batch))), None, batch.value_mask)
    loss, logs = rl.critic_loss_fn(cfg, counts)(mb, out[..., :1])
    return {"loss": round(float(loss), 6), "logs": {k: round(float(v), 6) for k, v in sorted(logs.items())}}


def obs_minibatches(ctx, cfg):
    from megarl.trainer import rl

    return rl.split_minibatches(fixed_batch(cfg).lengths, cfg.algorithm.mini_batch_size, cfg.trainer.seed, 0, 1)


def _run_components(ctx, cfg):
    """The base run's components with this config (the phases read cfg at call time)."""
    from megarl.trainer.components import build_components

    key = ("run", cfg.model.hf_path)
    if key not in ctx.cache:
        ctx.cache[key] = build_components(_base(ctx, [f"model.hf_path={cfg.model.hf_path}"]))
    return dataclasses.replace(ctx.cache[key], cfg=cfg)


def obs_sync_buckets(ctx, cfg):
    run = _run_components(ctx, cfg)
    engine, seen = run.engine, []
    real = engine.update_weights

    def counting(stream):
        buckets = [list(b) for b in stream]
        seen.append(len(buckets))
        real(iter(buckets))

    engine.update_weights = counting
    try:
        run.sync_weights(0)
    finally:
        engine.update_weights = real
    return seen


def obs_generation_offloads(ctx, cfg):
    run = _run_components(ctx, cfg)
    calls = []
    for m in run.train_models:
        m.offload = (lambda m=m: calls.append(type(m).__name__))
    try:
        with run.generation(release=True):
            pass
    finally:
        for m in run.train_models:
            del m.offload
    return len(calls)


def obs_sync_dtypes(ctx, cfg):
    """The dtypes of the tensors the engine gets in a weight sync, with their counts."""
    run = _run_components(ctx, cfg)
    engine, seen = run.engine, {}
    real = engine.update_weights

    def counting(stream):
        buckets = [list(b) for b in stream]
        for b in buckets:
            for _, t in b:
                seen[str(t.dtype)] = seen.get(str(t.dtype), 0) + 1
        real(iter(buckets))

    engine.update_weights = counting
    try:
        run.sync_weights(0)
    finally:
        engine.update_weights = real
    return sorted(seen.items())


def obs_sync_offloads(ctx, cfg):
    """What the weight sync moves off the GPU first: (model, with its weights) per offload call."""
    run = _run_components(ctx, cfg)
    calls = []
    for m in run.train_models:
        m.offload = (lambda weights=True, m=m: calls.append((type(m).__name__, weights)))
    try:
        run.sync_weights(0)
    finally:
        for m in run.train_models:
            del m.offload
    return calls


def obs_evaluate(ctx, cfg):
    run = _run_components(ctx, cfg)
    run.sync_weights(0)
    seen = []
    real = run.worker.generate

    def recording(items, encoded, sampling, **kw):
        trajs = real(items, encoded, sampling, **kw)
        seen.append((sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens, len(trajs)))
        return trajs

    run.worker.generate = recording
    try:
        run.evaluate(0)
    finally:
        run.worker.generate = real
    return seen


def obs_loop(ctx, cfg):
    """One RL run: its metrics rows, eval rows, checkpoints and TensorBoard files (never the run
    directory's name: that is identity, see `normalise`)."""
    from megarl.trainer.loop import train

    run_dir = Path(cfg.trainer.run_dir)
    train(cfg)
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError as e:
        return _err(e)
    return {"steps": [r["step"] for r in rows if "actor/pg_loss" in r or "critic/value_loss" in r],
            "actor_steps": [r["step"] for r in rows if "actor/pg_loss" in r],
            "eval_steps": [r["step"] for r in rows if "eval/accuracy" in r],
            "kl": [round(r.get("actor/approx_kl", 0.0), 7) for r in rows if "actor/pg_loss" in r],
            # the policy's entropy at the sampled tokens: which tokens were sampled (trainer.seed)
            "entropy": [round(r["actor/entropy"], 5) for r in rows if "actor/entropy" in r],
            "reward": [r.get("reward/mean") for r in rows if "reward/mean" in r],
            "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")),
            "tensorboard": (run_dir / "tb").exists()}


RUN_B = "run_b"  # trainer.run_dir's changed value, under the liveness root


def obs_run_dir(ctx, cfg):
    """One RL run: whether its metrics and checkpoints landed in {root}/run_b. The base run uses
    another directory; a trainer that ignored trainer.run_dir would write both runs elsewhere."""
    from megarl.trainer.loop import train

    train(cfg)
    where = ctx.root / RUN_B
    return {"metrics_in_run_b": (where / "metrics.jsonl").exists(),
            "checkpoints_in_run_b": sorted(p.name for p in (where / "checkpoints").glob("step_*"))}


def obs_sft(ctx, cfg):
    from megarl.trainer.sft import load_sft_rows, sft_run_config

    try:
        rows, skipped = load_sft_rows(cfg.sft.data_path, _hf(ctx, cfg)[1], cfg.sft.max_len)
    except (ValueError, FileNotFoundError) as e:
        return _err(e)
    c = sft_run_config(cfg, len(rows))
    return {"rows": len(rows), "skipped": len(skipped), "steps": c.trainer.total_steps, "lr": c.actor.lr,
            "warmup": c.actor.lr_warmup_steps}


def obs_quickstart_model(ctx, cfg):
    """The tiny model `megarl quickstart` builds from quickstart.*: its type, parameter count and
    logits on a short text (the experts each token is routed to change them)."""
    from megarl.quickstart import tiny_model_spec
    from megarl.tasks.tiny_model import build_byte_tokenizer, build_tiny_model

    tok = build_byte_tokenizer()
    model = build_tiny_model(tok, tiny_model_spec(cfg))
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("12 + 34 = 46")])).logits
    return {"model_type": model.config.model_type, "params": sum(p.numel() for p in model.parameters()),
            "logits_abs_sum": round(float(logits.abs().sum()), 3)}


def obs_quickstart_task(ctx, cfg):
    """The files the quickstart task writes: their names and the first train row's problem."""
    import json

    from megarl.tasks import quickstart_task

    out = ctx.root / f"task_{cfg.quickstart.task}"
    if not out.exists():
        quickstart_task(cfg.quickstart.task).write_files(out, cfg)
    rows = (out / "train.jsonl").read_text().splitlines()
    return {"files": sorted(p.name for p in out.iterdir()), "first": json.loads(rows[0]).get("problem")}


# --------------------------------------------------------------------------- witnesses
def obs_async_save(ctx, cfg):
    """What `latest` and step_1 hold right after RunComponents.save returns, and after finalising."""
    import tempfile

    from megarl.trainer import checkpoint
    from megarl.trainer.state import TrainerState

    run = _run_components(ctx, cfg)
    run.cfg.trainer.run_dir = tempfile.mkdtemp(dir=ctx.root)
    run.save(TrainerState(step=1))
    latest = checkpoint.read_latest(run.cfg.trainer.run_dir)
    meta = (checkpoint.step_dir(run.cfg.trainer.run_dir, 1) / "actor" / "model" / "metadata.json").exists()
    checkpoint.finalize_async_saves(blocking=True)
    return {"latest_at_return": latest and latest.name, "metadata_at_return": meta,
            "latest_finalised": checkpoint.read_latest(run.cfg.trainer.run_dir).name}


def W(value: str, obs, *base: str):
    """Changing the field to `value` (on the base config plus `base` overrides) changes obs."""
    return {"value": value, "obs": obs, "base": list(base)}


LOOP = ["trainer.total_steps=1", "rollout.prompts_per_step=2", "algorithm.mini_batch_size=4", "critic.enable=false"]
CRITIC_GAE = ["algorithm.advantage=gae"]
KL_REWARD = ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"]
TPPO = ["algorithm.advantage=egae", "rollout.window_tokens=4"]

WITNESSES = {
    "model.name": W("qwen2.5-32b", obs_planner, "model.name=qwen2.5-7b"),
    "model.hf_path": W("{root}/model_b", obs_hf),
    "model.load": W("{root}/ckpt_actor", obs_actor),
    "model.critic_load": W("{root}/ckpt_critic", obs_critic),
    "model.dtype": W("bf16", obs_actor),
    "model.attention_kernel": W("blockwise", obs_attention_kernel),
    "model.attention_backend": W("flash", obs_model_options),
    "model.transformer_impl": W("transformer_engine", obs_impl),
    "model.fp8": W("hybrid", obs_model_options, "model.fp8=e4m3", "model.transformer_impl=transformer_engine",
                   "model.dtype=bf16"),
    "model.fp8_recipe": W("tensorwise", obs_model_options, "model.fp8=e4m3", "model.transformer_impl=transformer_engine",
                          "model.dtype=bf16"),
    "model.recompute": W("selective", obs_model_options),
    "model.recompute_method": W("block", obs_model_options, "model.recompute=full"),
    "model.recompute_num_layers": W("2", obs_model_options, "model.recompute=full"),
    "model.sequence_parallel": W("true", obs_model_options, "parallel.tp=2", "model.transformer_impl=transformer_engine"),
    "model.cp_comm_type": W("a2a", obs_model_options, "parallel.cp=2"),
    "parallel.tp": W("2", obs_parallel),
    "parallel.pp": W("2", obs_parallel),
    "parallel.cp": W("2", obs_parallel),
    "parallel.ep": W("2", obs_parallel),
    "parallel.vpp": W("2", obs_parallel, "parallel.pp=2"),
    "parallel.etp": W("2", obs_parallel),
    "parallel.rollout_tp": W("2", obs_engine_group),
    "parallel.nodes": W("2", obs_world),
    "parallel.gpus_per_node": W("4", obs_world),
    "data.train_path": W("{task_train}", obs_data),
    "data.eval": W("[]", obs_data),
    "data.prompt_key": W("alt_problem", obs_data, "data.eval=[]"),
    "data.answer_key": W("alt_answer", obs_data, "data.eval=[]"),
    "data.reference_key": W("alt_reference", obs_data),
    "data.source_key": W("alt_source", obs_data),
    "data.default_data_source": W("code", obs_data, "data.source_key=missing"),
    "data.prompt_template": W("raw", obs_data),
    "data.apply_chat_template": W("true", obs_data),
    "data.max_prompt_len": W("12", obs_data),
    "data.shuffle": W("false", obs_data),
    "data.seed": W("7", obs_data),
    "rollout.engine": W("sglang", obs_engine),
    "rollout.n_samples_per_prompt": W("4", obs_sampling),
    "rollout.prompts_per_step": W("8", obs_collect),
    "rollout.temperature": W("0.5", obs_actor_loss),
    "rollout.top_p": W("0.9", obs_sampling),
    "rollout.top_k": W("5", obs_sampling),
    "rollout.max_new_tokens": W("7", obs_actor_loss, "algorithm.loss_agg=seq-mean-token-sum-norm"),
    "rollout.fire": W("true", obs_sampling),
    "rollout.fire_temperature": W("10.0", obs_sampling),
    "rollout.fire_top_k": W("4", obs_sampling),
    "rollout.function": W("megarl.trainer.step_collector:collect_step_batch", obs_collect_function,
                          "rollout.function=tests.distributed.scripts_liveness:ScriptedWorker"),
    "rollout.weight_bucket_mb": W("4", obs_sync_buckets, "model.hf_path={root}/model_c"),
    "rollout.offload_train_state": W("false", obs_generation_offloads),
    "rollout.sync_from_host": W("true", obs_sync_offloads),
    "rollout.weights_dtype": W("fp8", obs_sync_dtypes),
    "rollout.gen_batch_prompts": W("8", obs_collect, "algorithm.dynamic_sampling=true"),
    "rollout.max_gen_batches": W("1", obs_collect, "algorithm.dynamic_sampling=true", "rollout.prompts_per_step=8",
                                 "algorithm.mini_batch_size=16"),
    "rollout.kv_cache_gb": W("1e-6", obs_rollout_kv_cache),
    "rollout.sglang_context_length": W("50000", obs_sglang_server_args),
    "rollout.sglang_chunked_prefill_size": W("8192", obs_sglang_server_args),
    "rollout.sglang_server_args": W("{{attention_backend: triton}}", obs_sglang_server_args),  # str.format braces
    "rollout.sglang_dp_size": W("2", obs_sglang_server_args, "rollout.engine=sglang", "parallel.rollout_tp=2"),
    "rollout.sglang_ep_size": W("2", obs_sglang_server_args, "rollout.engine=sglang", "parallel.rollout_tp=2"),
    "rollout.carry_over_groups": W("true", obs_collect, "algorithm.dynamic_sampling=true", "rollout.gen_batch_prompts=8"),
    "rollout.window_tokens": W("4", obs_sampling, "algorithm.advantage=egae"),
    "rollout.max_staleness": W("1", obs_windows, *TPPO),
    "rollout.stale_action": W("drop", obs_windows, *TPPO, "rollout.max_staleness=1"),
    "algorithm.advantage": W("rloo", obs_advantages),
    "algorithm.norm_adv_by_std": W("false", obs_advantages),
    "algorithm.whiten_advantages": W("true", obs_advantages, *CRITIC_GAE),
    "algorithm.policy_loss": W("vanilla_pg", obs_actor_loss),
    "algorithm.loss_agg": W("seq-mean-token-mean", obs_actor_loss),
    "algorithm.clip_low": W("0.01", obs_actor_loss),
    "algorithm.clip_high": W("0.01", obs_actor_loss),
    "algorithm.clip_c": W("1.1", obs_actor_loss),
    "algorithm.gspo_clip_low": W("0.05", obs_actor_loss, "algorithm.policy_loss=gspo"),
    "algorithm.gspo_clip_high": W("0.05", obs_actor_loss, "algorithm.policy_loss=gspo"),
    "algorithm.cispo_clip_low": W("0.1", obs_actor_loss, "algorithm.policy_loss=cispo"),
    "algorithm.cispo_clip_high": W("0.05", obs_actor_loss, "algorithm.policy_loss=cispo"),
    "algorithm.sapo_tau_pos": W("3.0", obs_actor_loss, "algorithm.policy_loss=sapo"),
    "algorithm.sapo_tau_neg": W("3.0", obs_actor_loss, "algorithm.policy_loss=sapo"),
    "algorithm.clip_cov_ratio": W("1.0", obs_actor_loss, "algorithm.policy_loss=clip_cov", "algorithm.clip_cov_lb=-100",
                                  "algorithm.clip_cov_ub=100"),
    "algorithm.clip_cov_lb": W("-100.0", obs_actor_loss, "algorithm.policy_loss=clip_cov", "algorithm.clip_cov_ratio=1.0"),
    "algorithm.clip_cov_ub": W("0.5", obs_actor_loss, "algorithm.policy_loss=clip_cov", "algorithm.clip_cov_ratio=1.0",
                               "algorithm.clip_cov_lb=0.0"),
    "algorithm.kl_cov_ratio": W("0.5", obs_actor_loss, "algorithm.policy_loss=kl_cov"),
    "algorithm.kl_cov_coef": W("5.0", obs_actor_loss, "algorithm.policy_loss=kl_cov"),
    "algorithm.gmpo_clip_low": W("0.01", obs_actor_loss, "algorithm.policy_loss=gmpo"),
    "algorithm.gmpo_clip_high": W("0.01", obs_actor_loss, "algorithm.policy_loss=gmpo"),
    "algorithm.gpg_norm_by_std": W("true", obs_advantages, "algorithm.advantage=gpg"),
    "algorithm.gamma": W("0.5", obs_advantages, *CRITIC_GAE),
    "algorithm.lam_actor": W("0.5", obs_advantages, *CRITIC_GAE),
    "algorithm.lam_critic": W("0.5", obs_advantages, *CRITIC_GAE),
    "algorithm.length_adaptive_alpha": W("0.05", obs_advantages, *CRITIC_GAE),
    "algorithm.kl_coef": W("0.1", obs_actor_loss),
    "algorithm.kl_type": W("k1", obs_actor_loss, "algorithm.kl_coef=0.1"),
    "algorithm.kl_in_reward": W("true", obs_advantages, "algorithm.kl_coef=0.1"),
    "algorithm.kl_target": W("0.1", obs_kl_controller, *KL_REWARD),
    "algorithm.kl_horizon": W("100.0", obs_kl_controller, *KL_REWARD, "algorithm.kl_target=0.1"),
    "algorithm.entropy_coef": W("0.1", obs_actor_loss),
    "algorithm.pos_lm_coef": W("0.1", obs_actor_loss),
    "algorithm.value_clip": W("0.01", obs_critic_loss),
    "algorithm.dynamic_sampling": W("true", obs_collect),
    "algorithm.overlong_penalty": W("true", obs_score),
    "algorithm.overlong_max_len": W("7", obs_score, "algorithm.overlong_penalty=true"),
    "algorithm.overlong_cache_len": W("2", obs_score, "algorithm.overlong_penalty=true"),
    "algorithm.overlong_factor": W("2.0", obs_score, "algorithm.overlong_penalty=true"),
    "algorithm.overlong_filter": W("true", obs_masks),
    "algorithm.value_pretrain_steps": W("1", obs_advantages, *CRITIC_GAE, "algorithm.lam_critic=0.5"),
    # any explained variance meets -1e9 (it is 0 when all samples score the same): pretraining ends
    # after step 1 and the actor trains at step 2
    "algorithm.value_pretrain_ev_target": W("-1e9", obs_loop, *LOOP, "critic.enable=true", *CRITIC_GAE,
                                            "trainer.total_steps=2", "algorithm.value_pretrain_steps=2"),
    "algorithm.rollout_is": W("tis", obs_rollout_is),
    "algorithm.rollout_is_cap": W("1.5", obs_rollout_is, "algorithm.rollout_is=tis"),
    "algorithm.retrain_earlier_windows": W("true", obs_window_masks),
    # every reward of the untrained model is the same (advantages 0): the entropy bonus makes the
    # first epoch move the policy, so the second one sees a ratio != 1 (approx_kl > 0)
    "algorithm.ppo_epochs": W("2", obs_loop, *LOOP, "algorithm.entropy_coef=0.01"),
    "algorithm.mini_batch_size": W("4", obs_minibatches),
    "critic.enable": W("false", obs_components),
    "critic.init_from": W("{root}/ckpt_critic", obs_critic),
    "reward": W("{{sources: {{arith: math}}, correct_score: 2.0}}", obs_score),
    "trainer.total_steps": W("2", obs_loop, *LOOP),
    "trainer.seed": W("5", obs_loop, *LOOP),
    "trainer.run_dir": W("{root}/" + RUN_B, obs_run_dir, *LOOP),
    # two steps: the last step always saves and evaluates, so one step would hide the interval
    "trainer.save_interval": W("1", obs_loop, *LOOP, "trainer.total_steps=2"),
    "trainer.keep_last": W("1", obs_loop, *LOOP, "trainer.total_steps=2", "trainer.save_interval=1"),
    "trainer.eval_interval": W("1", obs_loop, *LOOP, "trainer.total_steps=2"),
    "trainer.log_interval": W("2", obs_loop, *LOOP, "trainer.total_steps=2"),
    "trainer.tensorboard": W("true", obs_loop, *LOOP),
    "trainer.val_before_train": W("true", obs_loop, *LOOP),
    "trainer.async_save": W("true", obs_async_save),
    "eval.n_samples": W("2", obs_evaluate),
    "eval.temperature": W("0.7", obs_evaluate),
    "eval.top_p": W("0.5", obs_evaluate),
    "eval.max_new_tokens": W("3", obs_evaluate),
    "sft.data_path": W("{task_sft}", obs_sft),
    "sft.epochs": W("2", obs_sft),
    "sft.max_steps": W("5", obs_sft),
    "sft.lr": W("0.5", obs_sft),
    "sft.lr_warmup_steps": W("3", obs_sft),
    "sft.batch_size": W("2", obs_sft),
    "sft.max_len": W("30", obs_sft),
    "quickstart.task": W("arith_longtail", obs_quickstart_task),
    "quickstart.family": W("qwen2_moe", obs_quickstart_model),
    "quickstart.num_experts": W("4", obs_quickstart_model, "quickstart.family=qwen3_moe"),
    "quickstart.moe_topk": W("4", obs_quickstart_model, "quickstart.family=qwen2_moe"),
    "quickstart.moe_intermediate": W("96", obs_quickstart_model, "quickstart.family=qwen3_moe"),
}
OPTIM_CHANGES = {"lr": "0.01", "min_lr": "0.0005", "lr_warmup_steps": "3", "lr_decay_style": "cosine",
                 "lr_decay_steps": "3", "weight_decay": "0.5", "adam_beta1": "0.5", "adam_beta2": "0.5",
                 "adam_eps": "0.001", "clip_grad": "0.5", "max_tokens_per_microbatch": "48",
                 "use_distributed_optimizer": "false", "offload_optimizer": "true"}
OPTIM_BASE = {"min_lr": ["lr_decay_style=linear"], "lr_decay_steps": ["lr_decay_style=linear"]}
for _role, _obs in (("actor", obs_actor), ("critic", obs_critic)):
    for _name, _value in OPTIM_CHANGES.items():
        WITNESSES[f"{_role}.{_name}"] = W(_value, _obs, *(f"{_role}.{b}" for b in OPTIM_BASE.get(_name, [])))


def _fill(s: str, ctx: Ctx) -> str:
    return s.format(root=ctx.root, task_train=ctx.task["train"], task_sft=ctx.task["sft"])


def _base(ctx: Ctx, extra=()):
    from megarl.config import load_config

    return load_config(None, base_overrides(ctx) + [f"trainer.run_dir={ctx.root / 'base'}"] + list(extra))


IDENTITY_KEYS = {"run_dir", "pid", "host", "hostname", "time", "timestamp", "wall_time"}


def _identity_key(k) -> bool:
    return isinstance(k, str) and (k in IDENTITY_KEYS or k.startswith(("time/", "perf/")))


def normalise(value, ctx: Ctx, run_dir: Path):
    """An observation without identity, so that base and changed runs compare only behaviour:
    dict entries keyed by IDENTITY_KEYS or time/ and perf/ metrics are dropped, and in every
    string the run's directory (path or name) becomes <run_dir> and the liveness root <root>.
    The base and changed observations each run in their own directory; left in, the names alone
    would make every observation that mentions them differ whatever the code does."""
    if isinstance(value, dict):
        return {k: normalise(v, ctx, run_dir) for k, v in value.items() if not _identity_key(k)}
    if isinstance(value, (list, tuple)):
        return type(value)(normalise(v, ctx, run_dir) for v in value)
    if isinstance(value, str):
        value = value.replace(str(run_dir), "<run_dir>").replace(str(ctx.root), "<root>")
        return re.sub(rf"(?<![\w.-]){re.escape(run_dir.name)}(?![\w.-])", "<run_dir>", value)
    return value


def _observe(ctx, obs, overrides, run_dir: Path):
    from megarl.config import ConfigError, load_config

    try:
        cfg = load_config(None, base_overrides(ctx) + overrides + [f"trainer.run_dir={run_dir}"]
                          if not any(o.startswith("trainer.run_dir=") for o in overrides)
                          else base_overrides(ctx) + overrides)
    except ConfigError as e:
        return normalise(_err(e), ctx, run_dir)
    return normalise(obs(ctx, cfg), ctx, Path(cfg.trainer.run_dir))


def _save_checkpoints(ctx: Ctx) -> None:
    """Actor and critic torch_dist checkpoints whose weights differ from the HF model's."""
    from megarl.trainer import build

    cfg = _base(ctx)
    hf, _ = _hf(ctx, cfg)
    actor = build.build_actor(cfg, hf)
    critic = build.build_critic(cfg, hf, actor)
    for model, name in ((actor, "ckpt_actor"), (critic, "ckpt_critic")):
        with torch.no_grad():
            for p in model.modules[0].parameters():
                p.add_(0.01)
        model.optimizer = None
        model.save(str(ctx.root / name))


def main(root: str, out: str, only: list[str]) -> None:
    from megarl.parallel.distributed import ParallelSizes, init_distributed

    ctx = Ctx(Path(root))
    init_distributed(ParallelSizes(), seed=0)
    _save_checkpoints(ctx)
    results = {}
    for i, (field, w) in enumerate(sorted(WITNESSES.items())):
        if only and field not in only:
            continue
        base = [_fill(b, ctx) for b in w["base"]]
        changed = base + [f"{field}={_fill(w['value'], ctx)}"]
        key = (w["obs"].__name__, tuple(base))
        if key not in ctx.cache:
            ctx.cache[key] = _observe(ctx, w["obs"], base, ctx.root / f"run_base_{i}")
        results[field] = {"base": repr(ctx.cache[key]),
                          "changed": repr(_observe(ctx, w["obs"], changed, ctx.root / f"run_{i}"))}
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
