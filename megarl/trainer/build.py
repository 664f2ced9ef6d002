"""Builds what the RL loop needs from a config: models, engine, rewards, data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

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
    return AutoConfig.from_pretrained(hf_path), AutoTokenizer.from_pretrained(hf_path)


def build_actor(cfg, hf_config, optim=True, load: str | None = None) -> TrainModel:
    from megarl.weights import load_hf_weights

    model = TrainModel(hf_config, cfg.actor if optim else None, dtype=cfg.model.dtype,
                       impl=resolve_impl(cfg.model), total_steps=cfg.trainer.total_steps)
    load = load or cfg.model.load
    if load:
        model.load(load, load_optimizer=False)
    else:
        load_hf_weights(model.modules, cfg.model.hf_path)
    return model


def build_critic(cfg, hf_config) -> TrainModel:
    """Same architecture with a scalar value head, initialised from the actor's backbone (the
    head starts at zero) or from a critic checkpoint (`model.critic_load`)."""
    from megarl.weights import load_hf_weights

    critic = TrainModel(hf_config, cfg.critic, value_head=True, dtype=cfg.model.dtype,
                        impl=resolve_impl(cfg.model), total_steps=cfg.trainer.total_steps)
    if cfg.model.critic_load:
        critic.load(cfg.model.critic_load, load_optimizer=False)
    elif cfg.critic.init_from not in ("actor", ""):
        critic.load(cfg.critic.init_from, load_optimizer=False)
    else:
        load_hf_weights(critic.modules, cfg.model.hf_path)
    return critic


def build_engine(cfg, hf_config, tokenizer):
    from megarl.rollout.registry import make_engine

    if cfg.rollout.engine == "builtin":
        return make_engine("builtin", config=hf_config, tokenizer=tokenizer)
    return make_engine("sglang", model_path=cfg.model.hf_path, tp_size=cfg.parallel.rollout_tp,
                       mem_fraction_static=cfg.rollout.mem_fraction)


def build_rewards(cfg):
    from megarl.rewards import RewardConfig, RewardManager

    return RewardManager(RewardConfig.from_dict(cfg.reward))


@dataclass
class PromptData:
    train: object  # PromptSampler
    evals: dict[str, list]  # name -> list[PromptItem]
    encode: object  # items -> list[list[int]]


def build_data(cfg, tokenizer) -> PromptData:
    from megarl.data.dataset import PromptSampler, load_prompt_dataset
    from megarl.data.templates import render_prompt

    d = cfg.data
    kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, source_key=d.source_key,
              default_source=d.default_data_source)
    train = load_prompt_dataset(d.train_path, **kw)
    train = _filter_long(train, tokenizer, d)
    evals = {}
    for spec in d.eval:
        path = spec if isinstance(spec, str) else spec["path"]
        name = Path(path).stem if isinstance(spec, str) else spec.get("name", Path(path).stem)
        evals[name] = list(_filter_long(load_prompt_dataset(path, **kw), tokenizer, d).items)

    def encode(items):
        return [render_prompt(it, d.prompt_template, tokenizer, d.apply_chat_template) for it in items]

    sampler = PromptSampler(train, batch_prompts=cfg.rollout.prompts_per_step, seed=d.seed, shuffle=d.shuffle)
    return PromptData(train=sampler, evals=evals, encode=encode)


def _filter_long(dataset, tokenizer, d):
    from megarl.data.dataset import filter_by_prompt_length

    kept = filter_by_prompt_length(dataset, tokenizer, d.max_prompt_len, d.prompt_template, d.apply_chat_template)
    if dist.get_rank() == 0 and kept.skipped:
        log.warning("%s: skipped %d rows (first: %s)", dataset.path, len(kept.skipped), kept.skipped[:3])
    return kept
