"""Cross-field checks of a typed :class:`MegaRLConfig`.

:func:`validate_config` runs at load time; :func:`validate_world` needs the world size (launchers,
planner, process-group init); :func:`validate_model` needs the HF model config (model build).
Each collects every problem and raises one :class:`ConfigError` naming the dotted fields.
"""

from __future__ import annotations

import importlib.util

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from megarl.algorithms.registry import ADVANTAGES, POLICY_LOSSES
from megarl.algorithms.offpolicy import WEIGHTABLE_LOSSES
from megarl.config.errors import ConfigError
from megarl.config.schema import MegaRLConfig
from megarl.registry import is_dotted_path

CRITIC_ADVANTAGES = ("gae", "egae")


class _Errors:
    def __init__(self, where: Callable[[str], str] | None):
        self.where = where
        self.items: list[str] = []

    def check(self, ok: bool, path: str, msg: str) -> None:
        if not ok:
            src = f" (from {self.where(path)})" if self.where else ""
            self.items.append(f"{path}{src}: {msg}")

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


def _suggest(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def validate_config(cfg: MegaRLConfig, where: Callable[[str], str] | None = None) -> None:
    """Cross-field rules that need no world size and no model config."""
    e = _Errors(where)
    m, p, d, r, a = cfg.model, cfg.parallel, cfg.data, cfg.rollout, cfg.algorithm

    for name in ("tp", "pp", "cp", "ep", "rollout_tp", "nodes", "gpus_per_node"):
        e.check(getattr(p, name) >= 1, f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}")
    declared, mp = p.nodes * p.gpus_per_node, p.tp * p.pp * p.cp
    e.check(declared % mp == 0, "parallel.tp",
            f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {mp} does not divide the world parallel.nodes*parallel.gpus_per_node = {declared}")
    e.check(declared % p.rollout_tp == 0, "parallel.rollout_tp",
            f"{p.rollout_tp} does not divide the world parallel.nodes*parallel.gpus_per_node = {declared}")
    e.check(p.gpus_per_node % p.rollout_tp == 0 or p.rollout_tp % p.gpus_per_node == 0, "parallel.rollout_tp",
            f"{p.rollout_tp}: an engine takes part of one node or whole nodes (gpus_per_node = {p.gpus_per_node})")
    e.check(p.rollout_tp <= p.gpus_per_node or r.engine == "sglang", "parallel.rollout_tp",
            f"{p.rollout_tp} GPUs span {p.rollout_tp // max(p.gpus_per_node, 1)} nodes: only rollout.engine=sglang "
            "starts an engine over several nodes")
    e.check(p.vpp is None or (p.vpp >= 1 and p.pp > 1), "parallel.vpp", f"needs parallel.pp > 1 and vpp >= 1 (pp={p.pp}, vpp={p.vpp})")
    e.check(p.etp is None or p.etp >= 1, "parallel.etp", f"must be >= 1 or null, got {p.etp}")
    e.check(not m.sequence_parallel or p.tp > 1, "model.sequence_parallel", "needs parallel.tp > 1")
    e.check(m.fp8 is None or m.transformer_impl != "local", "model.fp8", "FP8 needs model.transformer_impl transformer_engine or auto")
    e.check(m.fp8 is None or m.dtype == "bf16", "model.fp8", f"FP8 training runs on bf16 parameters (model.dtype={m.dtype})")
    e.check(m.logprob_chunk_tokens >= 1, "model.logprob_chunk_tokens", f"must be >= 1, got {m.logprob_chunk_tokens}")
    e.check(m.recompute_num_layers >= 1, "model.recompute_num_layers", f"must be >= 1, got {m.recompute_num_layers}")
    e.check(m.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", f"must be >= 0, got {m.moe_aux_loss_coeff}")
    e.check(m.moe_expert_bias_update_rate >= 0, "model.moe_expert_bias_update_rate",
            f"must be >= 0, got {m.moe_expert_bias_update_rate}")
    _check_te_attention(e, cfg)

    e.check(d.max_prompt_len >= 1, "data.max_prompt_len", f"must be >= 1, got {d.max_prompt_len}")
    e.check(d.max_image_tokens is None or d.max_image_tokens >= 1, "data.max_image_tokens",
            f"must be >= 1 or null, got {d.max_image_tokens}")
    e.check(bool(d.image_placeholder), "data.image_placeholder", "must be a non-empty string")
    e.check(d.max_video_tokens is None or d.max_video_tokens >= 1, "data.max_video_tokens",
            f"must be >= 1 or null, got {d.max_video_tokens}")
    e.check(bool(d.video_placeholder) and d.video_placeholder != d.image_placeholder, "data.video_placeholder",
            f"must be a non-empty string other than data.image_placeholder, got {d.video_placeholder!r}")
    e.check(d.first_sources_decay in ("linear", "step"), "data.first_sources_decay",
            f"must be linear or step, got {d.first_sources_decay!r}")
    e.check(not d.first_sources or d.first_sources_steps >= 1, "data.first_sources_steps",
            f"data.first_sources={d.first_sources} needs first_sources_steps >= 1, got {d.first_sources_steps}")
    e.check(d.first_sources_steps >= 0, "data.first_sources_steps", f"must be >= 0, got {d.first_sources_steps}")

    e.check(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", f"must be >= 1, got {r.n_samples_per_prompt}")
    e.check(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
    e.check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    e.check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    e.check(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    e.check(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    e.check(0 < r.mem_fraction < 1, "rollout.mem_fraction", f"must be in (0, 1), got {r.mem_fraction}")
    e.check(r.weight_bucket_mb >= 1, "rollout.weight_bucket_mb", f"must be >= 1, got {r.weight_bucket_mb}")
    e.check(r.weights_dtype in ("bf16", "fp8"), "rollout.weights_dtype", f"must be bf16 or fp8, got {r.weights_dtype!r}")
    e.check(not r.sync_from_host or r.offload_train_state, "rollout.sync_from_host",
            "streams the weights from where rollout.offload_train_state puts them: set that true too")
    e.check(not r.fire or (r.fire_temperature > 0 and r.fire_top_k >= 1), "rollout.fire_top_k", "FIRE needs fire_temperature > 0 and fire_top_k >= 1")
    e.check(r.function is None or is_dotted_path(r.function), "rollout.function",
            f"must be 'package.module:function' or null, got {r.function!r}")
    gen = r.gen_batch_prompts
    e.check(gen is None or gen >= r.prompts_per_step, "rollout.gen_batch_prompts", f"must be >= rollout.prompts_per_step ({r.prompts_per_step}), got {gen}")
    e.check(r.max_gen_batches >= 1, "rollout.max_gen_batches", f"must be >= 1, got {r.max_gen_batches}")
    _check_windows(e, cfg)
    e.check(r.kv_cache_gb is None or r.kv_cache_gb > 0, "rollout.kv_cache_gb", f"must be > 0 or null, got {r.kv_cache_gb}")
    ctx_len = r.sglang_context_length
    e.check(ctx_len is None or ctx_len >= d.max_prompt_len + r.max_new_tokens, "rollout.sglang_context_length",
            f"must hold the longest sequence data.max_prompt_len + rollout.max_new_tokens = "
            f"{d.max_prompt_len + r.max_new_tokens} (a shorter context cuts responses early), or be null; got {ctx_len}")
    taken = sorted(set(r.sglang_server_args) & set(MEGARL_SERVER_ARGS))
    e.check(not taken, "rollout.sglang_server_args",
            "megarl sets " + ", ".join(f"{k} ({MEGARL_SERVER_ARGS[k]})" for k in taken) + " itself: remove "
            + ("it" if len(taken) == 1 else "them"))
    tp = cfg.parallel.rollout_tp
    e.check(r.sglang_dp_size >= 1 and tp % r.sglang_dp_size == 0, "rollout.sglang_dp_size",
            f"must divide parallel.rollout_tp ({tp}), got {r.sglang_dp_size}")
    e.check(r.sglang_ep_size >= 1 and tp % r.sglang_ep_size == 0, "rollout.sglang_ep_size",
            f"must divide parallel.rollout_tp ({tp}), got {r.sglang_ep_size}")
    e.check(r.engine == "sglang" or (r.sglang_dp_size == 1 and r.sglang_ep_size == 1), "rollout.sglang_dp_size",
            f"sglang_dp_size={r.sglang_dp_size} / sglang_ep_size={r.sglang_ep_size} configure SGLang; "
            f"rollout.engine is {r.engine!r}: set both to 1")
    chunk = r.sglang_chunked_prefill_size
    e.check(chunk is None or chunk == -1 or chunk >= 1, "rollout.sglang_chunked_prefill_size",
            f"must be >= 1, -1 (no chunking) or null, got {chunk}")

    e.check(a.clip_low >= 0 and a.clip_low < 1, "algorithm.clip_low", f"must be in [0, 1), got {a.clip_low}")
    e.check(a.clip_high >= 0, "algorithm.clip_high", f"must be >= 0, got {a.clip_high}")
    e.check(a.clip_c is None or a.clip_c > 1, "algorithm.clip_c", f"dual-clip c must be > 1 (or null), got {a.clip_c}")
    e.check(0 <= a.gspo_clip_low < 1, "algorithm.gspo_clip_low", f"must be in [0, 1), got {a.gspo_clip_low}")
    for name in ("gspo_clip_high", "cispo_clip_high", "gmpo_clip_low", "gmpo_clip_high", "kl_cov_coef"):
        e.check(getattr(a, name) >= 0, f"algorithm.{name}", f"must be >= 0, got {getattr(a, name)}")
    e.check(a.cispo_clip_low is None or a.cispo_clip_low >= 0, "algorithm.cispo_clip_low",
            f"must be >= 0 or null, got {a.cispo_clip_low}")
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        e.check(getattr(a, name) > 0, f"algorithm.{name}", f"must be > 0, got {getattr(a, name)}")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        e.check(0 < getattr(a, name) <= 1, f"algorithm.{name}", f"must be in (0, 1], got {getattr(a, name)}")
    e.check(a.clip_cov_lb < a.clip_cov_ub, "algorithm.clip_cov_ub",
            f"must be > algorithm.clip_cov_lb={a.clip_cov_lb}, got {a.clip_cov_ub}")
    e.check(0 <= a.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {a.gamma}")
    e.check(0 <= a.lam_actor <= 1, "algorithm.lam_actor", f"must be in [0, 1], got {a.lam_actor}")
    e.check(0 <= a.lam_critic <= 1, "algorithm.lam_critic", f"must be in [0, 1], got {a.lam_critic}")
    e.check(a.advantage in ADVANTAGES or is_dotted_path(a.advantage), "algorithm.advantage",
            f"unknown estimator {a.advantage!r}{_suggest(a.advantage, ADVANTAGES)}: one of {sorted(ADVANTAGES)} "
            "or 'package.module:function'")
    e.check(a.policy_loss in POLICY_LOSSES, "algorithm.policy_loss",
            f"unknown policy loss {a.policy_loss!r}{_suggest(a.policy_loss, POLICY_LOSSES)}: one of {sorted(POLICY_LOSSES)}")
    e.check(a.kl_target is None or (a.kl_target > 0 and a.kl_in_reward and a.kl_coef > 0), "algorithm.kl_target",
            f"the adaptive KL controller needs kl_target > 0, kl_in_reward=true and kl_coef > 0 (the initial beta); "
            f"got kl_target={a.kl_target}, kl_in_reward={a.kl_in_reward}, kl_coef={a.kl_coef}")
    e.check(a.kl_horizon > 0, "algorithm.kl_horizon", f"must be > 0, got {a.kl_horizon}")
    alpha = a.length_adaptive_alpha
    e.check(alpha is None or alpha > 0, "algorithm.length_adaptive_alpha", f"must be > 0 or null, got {alpha}")
    e.check(alpha is None or a.advantage in CRITIC_ADVANTAGES, "algorithm.length_adaptive_alpha", f"applies to GAE advantages only (algorithm.advantage={a.advantage})")
    needs_critic = a.advantage in CRITIC_ADVANTAGES
    e.check(not needs_critic or cfg.critic.enable, "critic.enable", f"algorithm.advantage={a.advantage} needs a critic: set critic.enable=true")
    e.check(a.value_pretrain_steps == 0 or cfg.critic.enable, "algorithm.value_pretrain_steps", "value pretraining needs critic.enable=true")
    e.check(a.value_pretrain_steps >= 0, "algorithm.value_pretrain_steps", f"must be >= 0, got {a.value_pretrain_steps}")
    e.check(a.value_pretrain_ev_target is None or a.value_pretrain_steps > 0, "algorithm.value_pretrain_ev_target",
            "needs algorithm.value_pretrain_steps > 0 (the cap on the pretraining steps)")
    e.check(a.value_pretrain_ev_target is None or a.value_pretrain_ev_target <= 1.0, "algorithm.value_pretrain_ev_target",
            f"an explained variance is at most 1, got {a.value_pretrain_ev_target}")
    e.check(a.value_clip is None or a.value_clip > 0, "algorithm.value_clip", f"must be > 0 or null, got {a.value_clip}")
    e.check(a.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {a.kl_coef}")
    e.check(a.entropy_coef >= 0, "algorithm.entropy_coef", f"must be >= 0, got {a.entropy_coef}")
    e.check(a.pos_lm_coef >= 0, "algorithm.pos_lm_coef", f"must be >= 0, got {a.pos_lm_coef}")
    group_needed = a.advantage == "rloo" or a.dynamic_sampling
    e.check(not group_needed or r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", f"must be >= 2 for rloo / dynamic sampling, got {r.n_samples_per_prompt}")
    l_max = a.overlong_max_len or r.max_new_tokens
    e.check(a.overlong_max_len is None or a.overlong_max_len <= r.max_new_tokens, "algorithm.overlong_max_len",
            f"L_max must not exceed the generation cap rollout.max_new_tokens={r.max_new_tokens} (the penalty would "
            f"never reach its full value), got {a.overlong_max_len}")
    e.check(not a.overlong_penalty or 0 < a.overlong_cache_len < l_max, "algorithm.overlong_cache_len",
            f"must be in (0, L_max={l_max}) (algorithm.overlong_max_len or rollout.max_new_tokens), got {a.overlong_cache_len}")
    e.check(a.overlong_factor >= 0, "algorithm.overlong_factor", f"must be >= 0, got {a.overlong_factor}")
    e.check(a.ppo_epochs >= 1, "algorithm.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}")
    batch = r.prompts_per_step * r.n_samples_per_prompt
    e.check(a.mini_batch_size >= 1 and batch % a.mini_batch_size == 0, "algorithm.mini_batch_size",
            f"must divide the rollout batch rollout.prompts_per_step * rollout.n_samples_per_prompt = {batch}, got {a.mini_batch_size}")

    seq_max = d.max_prompt_len + r.max_new_tokens
    if a.pag.enable:
        seq_max = _check_pag(e, cfg)
    if r.tools.enable:
        seq_max = _check_tools(e, cfg)
    for role in ("actor", "critic"):
        o = getattr(cfg, role)
        if role == "critic" and not cfg.critic.enable:
            continue
        e.check(o.lr > 0, f"{role}.lr", f"must be > 0, got {o.lr}")
        e.check(0 <= o.min_lr <= o.lr, f"{role}.min_lr", f"must be in [0, {role}.lr={o.lr}], got {o.min_lr}")
        e.check(o.lr_warmup_steps >= 0, f"{role}.lr_warmup_steps", f"must be >= 0, got {o.lr_warmup_steps}")
        e.check(o.lr_decay_steps is None or o.lr_decay_steps >= 1, f"{role}.lr_decay_steps", f"must be >= 1 or null, got {o.lr_decay_steps}")
        e.check(o.weight_decay >= 0, f"{role}.weight_decay", f"must be >= 0, got {o.weight_decay}")
        e.check(0 <= o.adam_beta1 < 1, f"{role}.adam_beta1", f"must be in [0, 1), got {o.adam_beta1}")
        e.check(0 <= o.adam_beta2 < 1, f"{role}.adam_beta2", f"must be in [0, 1), got {o.adam_beta2}")
        e.check(o.adam_eps > 0, f"{role}.adam_eps", f"must be > 0, got {o.adam_eps}")
        e.check(o.clip_grad >= 0, f"{role}.clip_grad", f"must be >= 0, got {o.clip_grad}")
        e.check(o.max_tokens_per_microbatch >= seq_max, f"{role}.max_tokens_per_microbatch",
                f"must hold one full sample: >= data.max_prompt_len + rollout.max_new_tokens = {seq_max} (PAG: all turns), got {o.max_tokens_per_microbatch}")
        e.check(o.max_tokens_per_microbatch % p.cp == 0, f"{role}.max_tokens_per_microbatch", f"must be divisible by parallel.cp={p.cp}")
        e.check(not o.offload_optimizer or o.use_distributed_optimizer, f"{role}.offload_optimizer",
                f"megatron offloads only the (precision-aware) distributed optimizer: set {role}.use_distributed_optimizer=true")

    t = cfg.trainer
    e.check(t.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {t.total_steps}")
    e.check(t.save_interval >= 0, "trainer.save_interval", f"must be >= 0, got {t.save_interval}")
    e.check(t.keep_last is None or t.keep_last >= 1, "trainer.keep_last", f"must be >= 1 or null, got {t.keep_last}")
    e.check(t.eval_interval >= 0, "trainer.eval_interval", f"must be >= 0, got {t.eval_interval}")
    e.check(t.log_interval >= 1, "trainer.log_interval", f"must be >= 1, got {t.log_interval}")
    e.check(len(set(t.loggers)) == len(t.loggers), "trainer.loggers", f"names a logger twice: {t.loggers}")
    e.check(p.collective_timeout_s > 0, "parallel.collective_timeout_s", f"must be > 0 seconds, got {p.collective_timeout_s}")
    ev = cfg.eval
    e.check(ev.n_samples >= 1, "eval.n_samples", f"must be >= 1, got {ev.n_samples}")
    e.check(ev.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {ev.temperature}")
    e.check(0 < ev.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {ev.top_p}")
    e.check(ev.max_new_tokens >= 1, "eval.max_new_tokens", f"must be >= 1, got {ev.max_new_tokens}")
    s = cfg.sft
    for name in ("epochs", "batch_size", "max_len"):
        e.check(getattr(s, name) >= 1, f"sft.{name}", f"must be >= 1, got {getattr(s, name)}")
    e.check(s.lr > 0, "sft.lr", f"must be > 0, got {s.lr}")
    q = cfg.quickstart
    e.check(importlib.util.find_spec(f"megarl.tasks.{q.task}") is not None if q.task.isidentifier() else False,
            "quickstart.task", f"no task module megarl.tasks.{q.task}")
    if q.family != "qwen2":
        e.check(q.num_experts >= 2, "quickstart.num_experts", f"an MoE family needs >= 2 experts, got {q.num_experts}")
        e.check(1 <= q.moe_topk <= q.num_experts, "quickstart.moe_topk",
                f"must be in 1..quickstart.num_experts ({q.num_experts}), got {q.moe_topk}")
        e.check(q.moe_intermediate >= 1, "quickstart.moe_intermediate", f"must be >= 1, got {q.moe_intermediate}")
    e.check(q.critic_sft_steps >= 0, "quickstart.critic_sft_steps", f"must be >= 0, got {q.critic_sft_steps}")
    e.check(q.critic_sft_steps == 0 or cfg.critic.enable, "quickstart.critic_sft_steps", "needs critic.enable=true")
    _check_prm(e, cfg)
    e.raise_if_any()


# sglang.Engine keywords megarl sets itself (megarl.rollout.sglang: SGLangEngine, server_args), with the field that says them
MEGARL_SERVER_ARGS = {
    "model_path": "model.hf_path", "tp_size": "parallel.rollout_tp", "mem_fraction_static": "rollout.mem_fraction",
    "context_length": "rollout.sglang_context_length", "chunked_prefill_size": "rollout.sglang_chunked_prefill_size",
    "enable_return_routed_experts": "algorithm.routing_replay", "enable_memory_saver": "(always on: colocation)",
    "dtype": "(the engine's dtype argument)", "load_format": "(the engine's load_format argument)",
    "base_gpu_id": "(this rank's GPU)", "random_seed": "(the engine's random_seed argument)",
    "enable_weights_cpu_backup": "(the engine's argument)", "skip_tokenizer_init": "(whether the model has tokenizer files)",
    "dp_size": "rollout.sglang_dp_size", "enable_dp_attention": "rollout.sglang_dp_size", "ep_size": "rollout.sglang_ep_size",
    "nnodes": "(parallel.rollout_tp / parallel.gpus_per_node)", "node_rank": "(the engine's node)",
    "dist_init_addr": "(the engine owner's address)",
}


# model.cp_comm_type values Transformer Engine's context-parallel attention accepts for packed
# (THD) rows, the only layout megarl trains on; why each other value fails there
THD_CP_COMM_TYPES = ("p2p", "a2a")
_CP_COMM_REFUSED = {
    "allgather": "Transformer Engine names its all-gather exchange 'all_gather' and raises 'Unsupported "
                 "communication type' for 'allgather'; its all-gather attention also refuses THD rows and the "
                 "padding_causal mask megatron uses for them",
    "a2a+p2p": "Transformer Engine's hierarchical CP refuses THD rows, and needs CP sub-groups "
               "(hierarchical_context_parallel_sizes) that megarl does not create",
}


def _check_te_attention(e: _Errors, cfg: MegaRLConfig) -> None:
    """Attention settings Transformer Engine refuses for packed rows (TE 2.11). transformer_impl
    auto counts as TE: it picks TE wherever TE and a GPU are present."""
    m, p = cfg.model, cfg.parallel
    e.check(m.cp_comm_type in THD_CP_COMM_TYPES, "model.cp_comm_type",
            f"{m.cp_comm_type!r} does not work on packed (THD) sequences, which megarl always trains on: "
            f"{_CP_COMM_REFUSED.get(m.cp_comm_type, 'unknown')}; use one of {list(THD_CP_COMM_TYPES)}")
    te = m.transformer_impl != "local"
    e.check(not te or m.attention_backend != "local", "model.attention_backend",
            f"'local' sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN to 0, which leaves the Transformer "
            f"Engine attention of model.transformer_impl={m.transformer_impl} (auto: TE wherever TE and a GPU are) no "
            "backend: TE raises 'No dot product attention backend is available'; use auto, flash or fused, or "
            "transformer_impl=local (megarl's own attention, whatever attention_backend says)")
    e.check(not te or p.cp == 1 or m.attention_backend != "unfused", "model.attention_backend",
            f"'unfused' leaves only Transformer Engine's unfused attention, which TE turns off under context "
            f"parallelism (parallel.cp={p.cp}), so no backend is left; use auto, flash or fused")


def _check_prm(e: _Errors, cfg: MegaRLConfig) -> None:
    """Code PRM (docs/algorithms.md §10): dense line rewards need a critic estimator; prm.path, when set,
    names a directory (null: <trainer.run_dir>/prm)."""
    pr = cfg.prm
    e.check(pr.path is None or bool(pr.path.strip()), "prm.path", "must be a directory or null (<trainer.run_dir>/prm)")
    e.check(not pr.dense_reward or cfg.algorithm.advantage in CRITIC_ADVANTAGES, "prm.dense_reward",
            f"dense line rewards need a per-token estimator: algorithm.advantage gae or egae, got {cfg.algorithm.advantage!r}")
    e.check(not pr.init_critic or cfg.critic.enable, "prm.init_critic", "needs critic.enable=true")
    e.check(not pr.init_critic or (cfg.model.critic_load is None and cfg.critic.init_from in ("actor", "")),
            "prm.init_critic", "conflicts with model.critic_load / a critic.init_from path: the critic starts from one checkpoint")
    for name in ("lambda_fail", "lambda_pass"):
        e.check(getattr(pr, name) >= 0, f"prm.{name}", f"must be >= 0, got {getattr(pr, name)}")
    for name in ("label_k", "label_prompts", "label_samples", "train_steps", "batch_size"):
        e.check(getattr(pr, name) >= 1, f"prm.{name}", f"must be >= 1, got {getattr(pr, name)}")


def _check_pag(e: _Errors, cfg: MegaRLConfig) -> int:
    """PAG (algorithm.pag.enable): a critic estimator, no windows / ReMax; returns the longest
    sequence: the prompt, T_max policy turns, T_max - 1 verifications (each up to
    rollout.max_new_tokens) and the instructions (at most one token per UTF-8 byte)."""
    a, g = cfg.algorithm, cfg.algorithm.pag
    e.check(a.advantage == "gae", "algorithm.advantage",
            f"algorithm.pag needs the critic estimator gae (turn-independent GAE), got {a.advantage!r}")
    e.check(cfg.rollout.window_tokens is None, "rollout.window_tokens", "T-PPO windows do not apply to PAG rollouts")
    e.check(g.max_policy_turns >= 1, "algorithm.pag.max_policy_turns", f"must be >= 1, got {g.max_policy_turns}")
    e.check(g.alpha >= 0, "algorithm.pag.alpha", f"must be >= 0, got {g.alpha}")
    e.check(g.answer_tail_chars >= 1, "algorithm.pag.answer_tail_chars", f"must be >= 1, got {g.answer_tail_chars}")
    for name in ("verify_instruction", "revise_instruction"):
        e.check(bool(getattr(g, name)), f"algorithm.pag.{name}", "must be a non-empty text")
    e.check(not g.role_adv_norm or a.whiten_advantages, "algorithm.pag.role_adv_norm",
            "RoleAdvNorm whitens advantages: it needs algorithm.whiten_advantages=true")
    turns = max(g.max_policy_turns, 1)
    templates = (turns - 1) * len((g.verify_instruction + g.revise_instruction).encode("utf-8"))
    return cfg.data.max_prompt_len + (2 * turns - 1) * cfg.rollout.max_new_tokens + templates


def _check_tools(e: _Errors, cfg: MegaRLConfig) -> int:
    """Tool-calling rollouts (rollout.tools.enable); returns the longest sequence: the prompt and
    the response budget (every turn and observation)."""
    r, t = cfg.rollout, cfg.rollout.tools
    for name in ("max_turns", "memory_mb", "max_output_chars", "max_workers"):
        e.check(getattr(t, name) >= 1, f"rollout.tools.{name}", f"must be >= 1, got {getattr(t, name)}")
    e.check(t.max_response_tokens is None or t.max_response_tokens >= 1, "rollout.tools.max_response_tokens",
            f"must be >= 1 or null, got {t.max_response_tokens}")
    e.check(t.timeout_s > 0, "rollout.tools.timeout_s", f"must be > 0 seconds, got {t.timeout_s}")
    for name in ("malformed_penalty", "budget_penalty"):
        e.check(getattr(t, name) >= 0, f"rollout.tools.{name}", f"a penalty is subtracted: must be >= 0, got "
                f"{getattr(t, name)}")
    e.check(not cfg.algorithm.pag.enable, "rollout.tools.enable", "does not combine with algorithm.pag.enable")
    e.check(r.window_tokens is None, "rollout.window_tokens", "T-PPO windows do not apply to tool-calling rollouts")
    if t.format == "code":
        e.check(t.python, "rollout.tools.python", "the code format calls the python interpreter: it must stay on")
        e.check(not t.functions, "rollout.tools.functions", "user tools need rollout.tools.format=chat_json (code "
                "blocks call only the interpreter)")
    else:
        e.check(t.python or bool(t.functions), "rollout.tools.functions", "chat_json with rollout.tools.python=false "
                "needs at least one user tool")
    for name, path in t.functions.items():
        e.check(name.isidentifier() and not (t.python and name == "python"), "rollout.tools.functions",
                f"tool name {name!r} must be an identifier other than the interpreter's 'python'")
        e.check(is_dotted_path(path), "rollout.tools.functions", f"{name}: {path!r} is not 'package.module:function'")
    return cfg.data.max_prompt_len + (t.max_response_tokens or r.max_new_tokens)


def _check_windows(e: _Errors, cfg: MegaRLConfig) -> None:
    """T-PPO successive batching (rollout.window_tokens) and the rollout IS correction."""
    r, a = cfg.rollout, cfg.algorithm
    w = r.window_tokens
    e.check(w is None or 1 <= w < r.max_new_tokens, "rollout.window_tokens",
            f"must be in [1, rollout.max_new_tokens={r.max_new_tokens}) or null, got {w}")
    e.check(w is None or a.advantage == "egae" or (is_dotted_path(a.advantage) and cfg.critic.enable),
            "rollout.window_tokens", f"unfinished samples have no reward yet: windows need algorithm.advantage=egae "
            f"(a critic bootstraps them), got {a.advantage!r}")
    e.check(w is None or not a.dynamic_sampling, "rollout.window_tokens", "does not combine with algorithm.dynamic_sampling")
    e.check(w is None or r.function is None, "rollout.window_tokens", "does not combine with a custom rollout.function")
    e.check(w is None or not r.fire, "rollout.window_tokens", "does not combine with rollout.fire: windowed "
            "responses start through the engine's continuation call, which samples no FIRE first token")
    e.check(a.name != "tppo" or w is not None, "algorithm.name", "tppo needs rollout.window_tokens (T-PPO's windows)")
    e.check(r.max_staleness is None or (r.max_staleness >= 1 and w is not None), "rollout.max_staleness",
            f"must be >= 1 (a carried sample is always 1 version old) and needs rollout.window_tokens, got {r.max_staleness}")
    e.check(a.rollout_is_cap >= 1, "algorithm.rollout_is_cap", f"must be >= 1, got {a.rollout_is_cap}")
    e.check(a.rollout_is is None or a.policy_loss in WEIGHTABLE_LOSSES, "algorithm.rollout_is",
            f"weights the per-token policy-gradient term, which policy_loss={a.policy_loss!r} does not have: "
            f"use one of {WEIGHTABLE_LOSSES}")


def data_parallel_size(cfg: MegaRLConfig, world_size: int) -> int:
    """DP = world / (TP * PP * CP), as megatron-core's initialize_model_parallel computes it."""
    p = cfg.parallel
    return world_size // (p.tp * p.pp * p.cp)


def expected_world_size(cfg: MegaRLConfig) -> int:
    """GPUs of the job described by parallel.nodes x parallel.gpus_per_node."""
    return cfg.parallel.nodes * cfg.parallel.gpus_per_node


def validate_world(cfg: MegaRLConfig, world_size: int) -> None:
    """Layout rules that need the world size: model-parallel sizes divide it, every DP rank gets data."""
    e = _Errors(None)
    p = cfg.parallel
    mp = p.tp * p.pp * p.cp
    e.check(world_size % mp == 0, "parallel", f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {mp} does not divide the world size {world_size}")
    if p.ep > 1:
        etp = p.etp or p.tp
        emp = etp * p.ep * p.pp
        e.check(world_size % emp == 0, "parallel.ep", f"etp*ep*pp = {etp}*{p.ep}*{p.pp} = {emp} does not divide the world size {world_size}")
    e.check(world_size % p.rollout_tp == 0, "parallel.rollout_tp", f"{p.rollout_tp} does not divide the world size {world_size}")
    if world_size % mp == 0:
        dp = world_size // mp
        mb = cfg.algorithm.mini_batch_size
        e.check(mb >= dp, "algorithm.mini_batch_size", f"{mb} samples cannot feed data-parallel size {dp} (world {world_size} / tp*pp*cp {mp})")
    e.raise_if_any()


def _get(hf: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = hf.get(name) if isinstance(hf, Mapping) else getattr(hf, name, None)
        if value is not None:
            return value
    return default


def validate_model(cfg: MegaRLConfig, hf_config: Any) -> None:
    """Layout rules that need the model: heads / KV heads / FFN divisible by TP, layers by PP(*VPP),
    experts by EP, heads by the rollout TP, TE's context-parallel exchange (model.cp_comm_type) that
    fits the attention. ``hf_config`` is an HF config object or its dict."""
    e = _Errors(None)
    p = cfg.parallel
    text = _get(hf_config, "text_config") or hf_config  # a vision-language config keeps its LM in text_config
    heads = _get(text, "num_attention_heads")
    kv = _get(text, "num_key_value_heads", default=heads)
    layers = _get(text, "num_hidden_layers")
    ffn = _get(text, "intermediate_size")
    experts = _get(text, "num_experts", "num_local_experts", "n_routed_experts")
    if heads is None or layers is None:
        raise ConfigError("validate_model: hf config lacks num_attention_heads / num_hidden_layers")
    e.check(heads % p.tp == 0, "parallel.tp", f"num_attention_heads={heads} is not divisible by tp={p.tp}")
    e.check(kv % p.tp == 0, "parallel.tp", f"num_key_value_heads={kv} is not divisible by tp={p.tp}")
    e.check(ffn is None or ffn % p.tp == 0, "parallel.tp", f"intermediate_size={ffn} is not divisible by tp={p.tp}")
    stages = p.pp * (p.vpp or 1)
    e.check(layers % stages == 0, "parallel.pp", f"num_hidden_layers={layers} is not divisible by pp*vpp={stages}")
    # with attention data parallelism SGLang splits heads over rollout_tp / sglang_dp_size GPUs
    dp_attn = cfg.rollout.sglang_dp_size if cfg.rollout.sglang_dp_size >= 1 and p.rollout_tp % cfg.rollout.sglang_dp_size == 0 else 1
    attn_tp, what = p.rollout_tp // dp_attn, ("rollout_tp" if dp_attn == 1 else
                                               f"rollout_tp / rollout.sglang_dp_size = {p.rollout_tp}/{dp_attn}")
    e.check(heads % attn_tp == 0, "parallel.rollout_tp", f"num_attention_heads={heads} is not divisible by {what}={attn_tp}")
    e.check(kv % attn_tp == 0 or attn_tp % kv == 0, "parallel.rollout_tp",
            f"num_key_value_heads={kv} and {what}={attn_tp}: one must divide the other")
    ep_engine = cfg.rollout.sglang_ep_size
    e.check(ep_engine == 1 or (bool(experts) and experts % ep_engine == 0), "rollout.sglang_ep_size",
            f"sglang_ep_size={ep_engine} needs an MoE model whose experts it divides (num_experts={experts})")
    if p.ep > 1:
        e.check(bool(experts), "parallel.ep", f"ep={p.ep} needs an MoE model (no num_experts in the HF config)")
        e.check(not experts or experts % p.ep == 0, "parallel.ep", f"num_experts={experts} is not divisible by ep={p.ep}")
    # megatron's MoE layer refuses to train at TP > 1 without sequence parallelism
    e.check(not experts or p.tp == 1 or cfg.model.sequence_parallel, "model.sequence_parallel",
            f"an MoE model (num_experts={experts}) at parallel.tp={p.tp} trains only with sequence parallelism")
    e.check(not cfg.model.freeze_vision or _get(hf_config, "vision_config") is not None, "model.freeze_vision",
            "freezes the vision tower, but the HF config has no vision_config (a text-only model): set it to false")
    e.check(bool(experts) or not cfg.algorithm.routing_replay, "algorithm.routing_replay",
            "replays the experts of an MoE model, but the HF config has no num_experts (a dense model): set it to false")
    e.check(bool(experts) or not cfg.model.freeze_router, "model.freeze_router",
            "freezes the router of an MoE model, but the HF config has no num_experts (a dense model): set it to false")
    _check_linear_attention(e, cfg, text)
    _check_te_cp_model(e, cfg, text, heads, kv)
    e.raise_if_any()


def _check_linear_attention(e: _Errors, cfg: MegaRLConfig, text: Any) -> None:
    """Gated delta-net layers (Qwen3-Next, Qwen3.5: `layer_types` "linear_attention"): no context
    parallelism (megarl's layer, like megatron-core 0.16.1's, has none), key and value heads split
    over the training and the rollout TP."""
    linear = sum(t == "linear_attention" for t in (_get(text, "layer_types") or []))
    if not linear:
        return
    p = cfg.parallel
    e.check(p.cp == 1, "parallel.cp", f"cp={p.cp}: the {linear} gated delta-net layers (layer_types "
            "'linear_attention') have no context parallelism; set parallel.cp=1")
    nk, nv = _get(text, "linear_num_key_heads", default=0), _get(text, "linear_num_value_heads", default=0)
    for field, size in (("parallel.tp", p.tp), ("parallel.rollout_tp", p.rollout_tp)):
        e.check(nk % size == 0 and nv % size == 0, field,
                f"linear_num_key_heads={nk} / linear_num_value_heads={nv} are not divisible by {field.split('.')[1]}={size}")


def _check_te_cp_model(e: _Errors, cfg: MegaRLConfig, text: Any, heads: int, kv: int) -> None:
    """What Transformer Engine 2.11's context parallelism asserts about the model
    (attention/dot_product_attention/context_parallel.py, `attn_forward_func_with_cp` and
    `AttnFuncWithCPAndQKVOA2A`): multi-latent attention (key width != value width) only with p2p
    or a2a+p2p; a2a only when each TP rank's query and key/value heads divide by CP."""
    m, p = cfg.model, cfg.parallel
    if m.transformer_impl == "local" or p.cp == 1 or m.cp_comm_type != "a2a":
        return
    k_dim = (_get(text, "qk_nope_head_dim", default=0) or 0) + (_get(text, "qk_rope_head_dim", default=0) or 0)
    v_dim = _get(text, "v_head_dim")
    mla = _get(text, "kv_lora_rank") is not None and v_dim is not None and k_dim != v_dim
    e.check(not mla, "model.cp_comm_type",
            f"'a2a' with multi-latent attention (kv_lora_rank; keys of qk_nope_head_dim + qk_rope_head_dim = {k_dim}, "
            f"values of v_head_dim = {v_dim}, as in DeepSeek-V3 / Kimi-K2) at parallel.cp={p.cp}: Transformer Engine's "
            "context parallelism runs multi-latent attention only with p2p or a2a+p2p ('Context parallelism does not "
            "support MLA'), and a2a+p2p refuses packed rows; use p2p")
    if mla or heads % p.tp or kv % p.tp:
        return  # said above, or by the tp checks
    q_rank, kv_rank = heads // p.tp, kv // p.tp
    e.check(q_rank % p.cp == 0 and kv_rank % p.cp == 0, "model.cp_comm_type",
            f"'a2a' spreads each TP rank's attention heads over the CP ranks, but num_attention_heads={heads} and "
            f"num_key_value_heads={kv} at parallel.tp={p.tp} leave {q_rank} query and {kv_rank} key/value heads per "
            f"TP rank, not both divisible by parallel.cp={p.cp} (Transformer Engine: 'The number of attention heads "
            "needs to be divisible by CP size'); use p2p, or a tp / cp that divides them")
