"""Builds what the RL loop needs from a config: models, engine, rewards, data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path


from megarl.config import MegaRLConfig
from megarl.trainer.tools import tool_schemas
from megarl.trainer.train_model import TrainModel

log = logging.getLogger(__name__)


def resolve_impl(model_cfg) -> str:
    if model_cfg.transformer_impl != "auto":
        return model_cfg.transformer_impl
    try:
        import transformer_engine  # noqa: F401
        import torch

        return "transformer_engine" if torch.cuda.is_available() else "local"
    except ImportError:
        return "local"


def load_hf_config_and_tokenizer(hf_path: str):
    from transformers import AutoConfig, AutoTokenizer

    if not hf_path or not Path(hf_path).is_dir():
        raise FileNotFoundError(f"model.hf_path: {hf_path!r} is not a directory with config.json + tokenizer")
    if not any((Path(hf_path) / name).exists() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer that encodes every prompt to no tokens
        raise FileNotFoundError(f"model.hf_path: {hf_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                "copy the model's tokenizer files into it")
    from megarl.models.deepseek import register_kimi_config

    register_kimi_config()  # Kimi-K2's model_type "kimi_k2" reads as DeepSeek-V3
    return AutoConfig.from_pretrained(hf_path), AutoTokenizer.from_pretrained(hf_path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def _padded_vocab(load: str | None, tp: int) -> int | None:
    from megarl.weights.dist_ckpt import padded_vocab_for, read_checkpoint_meta

    return padded_vocab_for(read_checkpoint_meta(load), tp) if load else None


def model_options(model_cfg, parallel_cfg) -> dict:
    """megatron TransformerConfig fields set by `model.*` and `parallel.sequence_parallel`:
    FP8 (TE), activation recompute, the attention backend, sequence parallelism, TE's CP exchange."""
    from megatron.core.transformer.enums import AttnBackend

    opts: dict = {"attention_backend": AttnBackend[model_cfg.attention_backend],
                  "sequence_parallel": bool(model_cfg.sequence_parallel and parallel_cfg.tp > 1)}
    if model_cfg.fp8 is not None:
        opts.update(fp8=model_cfg.fp8, fp8_recipe=model_cfg.fp8_recipe)
    if parallel_cfg.cp > 1:
        opts["cp_comm_type"] = model_cfg.cp_comm_type  # read by TE's attention; megarl's local one all-gathers
    if model_cfg.moe_aux_loss_coeff > 0:  # MoE only (megarl.models.builder drops moe_* for dense models)
        opts.update(moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
                    moe_router_load_balancing_type=model_cfg.moe_load_balancing_type)
    if model_cfg.moe_expert_bias_update_rate:  # sigmoid-routed MoE only (megarl.models.deepseek)
        opts["moe_router_bias_update_rate"] = model_cfg.moe_expert_bias_update_rate
    if model_cfg.recompute is not None:
        opts["recompute_granularity"] = model_cfg.recompute
        if model_cfg.recompute == "full":
            opts.update(recompute_method=model_cfg.recompute_method, recompute_num_layers=model_cfg.recompute_num_layers)
    return opts


def _train_model(cfg: MegaRLConfig, hf_config, optim, load: str | None, value_head: bool = False) -> TrainModel:
    """Builds the model and loads `load` (a megarl torch_dist model checkpoint) or, without
    one, the HF safetensors of model.hf_path (rank-local slice reads)."""
    from megatron.core import parallel_state as ps

    from megarl.models.attention_kernels import use_kernel
    from megarl.weights import load_hf_weights

    use_kernel(cfg.model.attention_kernel)
    model = TrainModel(hf_config, optim, value_head=value_head, dtype=cfg.model.dtype,
                       impl=resolve_impl(cfg.model), total_steps=cfg.trainer.total_steps,
                       padded_vocab=_padded_vocab(load, ps.get_tensor_model_parallel_world_size()),
                       seed=cfg.trainer.seed, batching=cfg.critic if value_head else cfg.actor,
                       model_options=model_options(cfg.model, cfg.parallel),
                       logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
                       freeze_vision=cfg.model.freeze_vision and optim is not None,
                       **({} if value_head or optim is None else actor_routing_options(cfg)))
    model.hf_source_dir = cfg.model.hf_path
    if load:
        model.load(load, load_optimizer=False)
    else:
        load_hf_weights(model.chunks, cfg.model.hf_path)
    if model.optimizer is not None:
        model.optimizer.reload_model_params()  # refresh fp32 main params from the loaded weights
    return model


def actor_routing_options(cfg: MegaRLConfig) -> dict:
    """MoE options of the trained actor (the reference model and the critic route natively)."""
    return dict(freeze_router=cfg.model.freeze_router, routing_replay=cfg.algorithm.routing_replay,
                track_routing=True)


def build_actor(cfg: MegaRLConfig, hf_config, optim=True) -> TrainModel:
    from megarl.config import validate_model

    validate_model(cfg, hf_config)  # layout and MoE rules that need the model (ConfigError naming the field)
    return _train_model(cfg, hf_config, cfg.actor if optim else None, cfg.model.load)


def build_critic(cfg: MegaRLConfig, hf_config, actor: TrainModel) -> TrainModel:
    """Same architecture with a scalar value head: loaded from `model.critic_load` (or a critic
    checkpoint path in critic.init_from), else initialised from a backbone with the value head as
    built: the actor's current one (critic.init_from=actor, copied in memory), or that of the
    policy-architecture checkpoint critic.init_from names (e.g. a longer-trained SFT model, as
    the reward model a value model is usually initialised from: VC-PPO, docs/algorithms.md §3)."""
    from megarl.weights.dist_ckpt import read_checkpoint_meta

    load = cfg.model.critic_load or (None if cfg.critic.init_from in ("actor", "") else cfg.critic.init_from)
    if cfg.prm.init_critic:  # code PRM: the critic starts as a copy of the PRM (backbone + head; [NS->C])
        load = _prm_checkpoint(cfg)
        log.info("critic initialised from the PRM checkpoint %s", load)
    backbone = actor
    if load and not read_checkpoint_meta(load).get("value_head"):  # a policy checkpoint: its backbone only
        backbone, load = _train_model(cfg, hf_config, None, load), None
    if load:
        return _train_model(cfg, hf_config, cfg.critic, load, value_head=True)
    critic = TrainModel(hf_config, cfg.critic, value_head=True, dtype=cfg.model.dtype,
                        impl=resolve_impl(cfg.model), total_steps=cfg.trainer.total_steps,
                        padded_vocab=actor.modules[0].vocab_size, seed=cfg.trainer.seed,
                        model_options=model_options(cfg.model, cfg.parallel),
                        logprob_chunk_tokens=cfg.model.logprob_chunk_tokens)
    critic.hf_source_dir = cfg.model.hf_path
    copied = critic.copy_backbone_from(backbone)
    log.info("critic initialised from the %s backbone (%d tensors)",
             "actor" if backbone is actor else cfg.critic.init_from, copied)
    return critic


def prm_dir(cfg: MegaRLConfig) -> Path:
    """Where the code PRM checkpoint lives: prm.path, else <trainer.run_dir>/prm."""
    return Path(cfg.prm.path) if cfg.prm.path else Path(cfg.trainer.run_dir) / "prm"


def _prm_checkpoint(cfg: MegaRLConfig) -> str:
    from megarl.weights.dist_ckpt import read_checkpoint_meta

    path = str(prm_dir(cfg))
    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"prm.path: {path!r} is not a PRM checkpoint dir (megarl.trainer.prm.ensure_prm writes one)")
    if not read_checkpoint_meta(path).get("value_head"):
        raise ValueError(f"prm.path: {path} is not a critic-architecture (value head) checkpoint")
    return path


def build_prm(cfg: MegaRLConfig, hf_config) -> TrainModel:
    """The code PRM for dense rewards: a forward-only value-head model loaded from prm.path."""
    return _train_model(cfg, hf_config, None, _prm_checkpoint(cfg), value_head=True)


def build_engine(cfg: MegaRLConfig, hf_config, tokenizer):
    from megarl.rollout.registry import make_engine

    if cfg.rollout.engine == "builtin":
        from megarl.parallel.distributed import device

        return make_engine("builtin", config=hf_config, tokenizer=tokenizer, device=device(),
                           kv_cache_gb=cfg.rollout.kv_cache_gb)
    from megarl.rollout.sglang.requests import server_args

    model_path, extra = cfg.model.hf_path, {}
    if cfg.rollout.weights_dtype == "fp8":  # SGLang serves the block-FP8 weights the stream sends
        model_path, extra = fp8_engine_dir(cfg), {"load_format": "dummy"}
    return make_engine("sglang", model_path=model_path, group=engine_group(cfg.parallel.rollout_tp),
                       return_routed_experts=cfg.algorithm.routing_replay, **server_args(cfg), **extra)


def fp8_engine_dir(cfg: MegaRLConfig) -> str:
    """<trainer.run_dir>/engine_fp8: model.hf_path's config (FP8 quantization_config) and tokenizer,
    written by rank 0 for every node's SGLang (rollout.sglang.weights.fp8_engine_checkpoint)."""
    import torch.distributed as dist

    from megarl.rollout.sglang.weights import fp8_engine_checkpoint

    out = Path(cfg.trainer.run_dir) / "engine_fp8"
    if dist.get_rank() == 0:
        fp8_engine_checkpoint(cfg.model.hf_path, out)
    dist.barrier()
    return str(out)


def engine_group(tp: int, timeout: timedelta | None = None):
    """The gloo group of the `tp` consecutive ranks (part of one node, or whole nodes) that share
    this rank's engine.

    Every rank creates every group (torch.distributed requires it); None when tp == 1. The
    ranks that own no engine wait on this group while the owner starts the engine or generates,
    so `timeout` (default 2 hours) must outlast the longest generation.
    """
    import os

    import torch.distributed as dist

    timeout = timedelta(hours=2) if timeout is None else timeout

    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp == 1:
        return None
    if world % tp or (local % tp and tp % local):
        raise ValueError(f"parallel.rollout_tp={tp} must divide the world ({world}) and either divide the ranks per "
                         f"node ({local}) or be a multiple of them: an engine takes part of one node or whole nodes")
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)), backend="gloo", timeout=timeout)
        if start <= rank < start + tp:
            mine = group
    return mine


JUDGE_SOURCES = ("genrm", "pairwise_genrm")


def build_rewards(cfg: MegaRLConfig):
    """The reward manager; with a GenRM source, also its judge (resource "judge"): a generative
    judge on a builtin engine loaded with `reward.judge_path` (an HF model directory; default:
    the policy's own model.hf_path, i.e. self-judging). `reward.judge` (a mapping) sets the
    judge's JudgeConfig fields plus `exact` (see build_judge); `reward.judge_train` is read by
    megarl.trainer.genrm_train only."""
    from megarl.rewards import RewardConfig, RewardManager

    reward = dict(cfg.reward)
    judge_path = reward.pop("judge_path", None)
    judge_opts = reward.pop("judge", None)
    reward.pop("judge_train", None)
    rcfg = RewardConfig.from_dict(reward)
    resources = {}
    if any(spec.fn in JUDGE_SOURCES for spec in rcfg.sources.values()):
        resources["judge"] = build_judge(judge_path or cfg.model.hf_path, judge_opts)
    return RewardManager(rcfg, resources)


def build_judge(hf_path: str, options: dict | None = None):
    """A GenerativeJudge on a builtin engine holding the HF checkpoint at `hf_path`.
    `options` (reward.judge): JudgeConfig fields, and `exact: true` for exact verdict
    probabilities from an HFNextTokenScorer over the same checkpoint (else verdicts are sampled)."""
    from megarl.parallel.distributed import device
    from megarl.rewards.genrm import GenerativeJudge, HFNextTokenScorer, judge_config
    from megarl.rollout.builtin import BuiltinEngine

    if not hf_path or not Path(hf_path).is_dir():
        raise FileNotFoundError(f"reward.judge_path: {hf_path!r} is not an HF model directory")
    options = dict(options or {})
    exact = options.pop("exact", False)
    jcfg = judge_config(options, "reward.judge")
    engine = BuiltinEngine.from_pretrained(hf_path, device=device())
    scorer = None
    if exact:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_path, dtype="float32").to(device()).eval()
        scorer = HFNextTokenScorer(model, pad_id=engine.tokenizer.pad_token_id or 0)
    return GenerativeJudge(engine, engine.tokenizer, jcfg, scorer)


@dataclass
class EvalSet:
    name: str
    items: list  # PromptItem with prompt_ids
    sampling: dict  # overrides of cfg.eval: n_samples, temperature, top_p, max_new_tokens


@dataclass
class PromptData:
    train: object  # PromptSampler or SourceScheduleSampler (data.first_sources)
    evals: list[EvalSet]
    encode: object  # items -> list[list[int]]


EVAL_SAMPLING_KEYS = ("n_samples", "temperature", "top_p", "max_new_tokens")
EVAL_SPEC_KEYS = {"name", "path", "prompt_key", "answer_key", "data_source", "prompt_template", *EVAL_SAMPLING_KEYS}


def _eval_spec(spec) -> dict:
    """An entry of data.eval: a dataset path, a path to an eval YAML (configs/eval/*.yaml), or
    an inline mapping with the same keys."""
    import yaml

    if isinstance(spec, str) and spec.endswith((".yaml", ".yml")):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"data.eval: {spec} does not exist")
        spec = yaml.safe_load(path.read_text()) or {}
        where = str(path)
    else:
        where = "data.eval"
        spec = {"path": spec} if isinstance(spec, str) else dict(spec)
    unknown = set(spec) - EVAL_SPEC_KEYS
    if unknown or "path" not in spec:
        raise ValueError(f"{where}: eval spec needs 'path' and only {sorted(EVAL_SPEC_KEYS)} (got {sorted(spec)})")
    if "name" not in spec:
        from megarl.data.formats import HF_PREFIX, hf_label

        spec["name"] = hf_label(spec["path"]) if str(spec["path"]).startswith(HF_PREFIX) else Path(spec["path"]).stem
    return spec


def image_inputs(cfg: MegaRLConfig, hf_config, tokenizer):
    """The checkpoint's image and video processing and vision tokens (`megarl.data.images.ImageInputs`)
    for a vision-language model, None for a text model."""
    if getattr(hf_config, "vision_config", None) is None:
        return None
    from megarl.data.images import ImageInputs
    from megarl.data.video import VideoInputs

    d = cfg.data
    videos = VideoInputs.from_pretrained(cfg.model.hf_path, hf_config, tokenizer, placeholder=d.video_placeholder,
                                         max_video_tokens=d.max_video_tokens)
    return ImageInputs.from_pretrained(cfg.model.hf_path, hf_config, tokenizer, placeholder=d.image_placeholder,
                                       max_image_tokens=d.max_image_tokens, videos=videos, video_key=d.video_key)


def build_eval_sets(cfg: MegaRLConfig, specs: list, tokenizer, images=None) -> list[EvalSet]:
    """The eval sets of `specs` (entries as in data.eval), templated and tokenised; keys a spec
    leaves out come from data.*."""
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset

    d = cfg.data
    tok = dict(max_prompt_len=d.max_prompt_len, apply_chat_template=d.apply_chat_template, images=images,
               image_key=d.image_key, tools=tool_schemas(cfg))
    evals = []
    for raw in specs:
        spec = _eval_spec(raw)
        ds = load_prompt_dataset(spec["path"], prompt_key=spec.get("prompt_key", d.prompt_key),
                                 answer_key=spec.get("answer_key", d.answer_key), source_key=d.source_key,
                                 default_source=spec.get("data_source", d.default_data_source),
                                 reference_key=d.reference_key)
        ds = tokenize_dataset(ds, tokenizer, template=spec.get("prompt_template", d.prompt_template), **tok)
        evals.append(EvalSet(spec["name"], list(ds.items), {k: spec[k] for k in EVAL_SAMPLING_KEYS if k in spec}))
    return evals


def build_data(cfg: MegaRLConfig, tokenizer, images=None) -> PromptData:
    """Training prompts (a resumable sampler) and eval sets, templated and tokenised; bad rows,
    rows with unusable images (`images`: an ImageInputs, vision-language models) and over-long
    prompts are skipped, counted and named in a warning by megarl.data."""
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
    from megarl.data.sampler import PromptSampler, SourceScheduleSampler

    d = cfg.data
    kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, source_key=d.source_key,
              default_source=d.default_data_source, reference_key=d.reference_key)
    tok = dict(template=d.prompt_template, max_prompt_len=d.max_prompt_len,
               apply_chat_template=d.apply_chat_template, images=images, image_key=d.image_key,
               tools=tool_schemas(cfg))
    if not d.train_path:
        raise ValueError("data.train_path is not set")
    train = tokenize_dataset(load_prompt_dataset(d.train_path, **kw), tokenizer, **tok)
    evals = build_eval_sets(cfg, d.eval, tokenizer, images)
    if d.first_sources:
        sampler = SourceScheduleSampler(train.items, cfg.rollout.prompts_per_step, d.seed, d.shuffle,
                                        d.first_sources, d.first_sources_steps, d.first_sources_decay)
    else:
        sampler = PromptSampler(train.items, batch_prompts=cfg.rollout.prompts_per_step, seed=d.seed, shuffle=d.shuffle)
    return PromptData(train=sampler, evals=evals, encode=lambda items: [list(it.prompt_ids) for it in items])
