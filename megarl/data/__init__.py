"""megarl.data: prompt datasets, prompt templates, a resumable sampler, packing and batching."""

from megarl.data.dataset import PromptDataset, PromptItem, load_prompt_dataset, tokenize_dataset
from megarl.data.packing import MicroBatches, balance_across_dp, token_budget_microbatches
from megarl.data.sampler import PromptSampler, shard_for_rank
from megarl.data.templates import (
    TEMPLATES, apply_template, get_template, register_template, render_prompt, render_text)

__all__ = [
    "PromptDataset", "PromptItem", "load_prompt_dataset", "tokenize_dataset",
    "MicroBatches", "balance_across_dp", "token_budget_microbatches",
    "PromptSampler", "shard_for_rank",
    "TEMPLATES", "apply_template", "get_template", "register_template", "render_prompt", "render_text",
]
