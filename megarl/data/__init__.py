"""megarl.data: prompt datasets, prompt templates, a resumable sampler, packing and batching."""

from megarl.data.dataset import PromptDataset, PromptItem, load_prompt_dataset, tokenize_dataset
from megarl.data.packing import (
    MicroBatches, PackedBatch, balance_across_dp, block_causal_mask, cu_seqlens_from_lengths,
    gather_response_values, next_token_labels, pack_prompt_response, pack_sequences,
    response_logit_mask, scatter_response_values, token_budget_microbatches, unpack)
from megarl.data.sampler import PromptSampler, shard_for_rank
from megarl.data.templates import (
    TEMPLATES, apply_template, get_template, register_template, render_prompt, render_text)

__all__ = [
    "PromptDataset", "PromptItem", "load_prompt_dataset", "tokenize_dataset",
    "MicroBatches", "PackedBatch", "balance_across_dp", "block_causal_mask", "cu_seqlens_from_lengths",
    "gather_response_values", "next_token_labels", "pack_prompt_response", "pack_sequences",
    "response_logit_mask", "scatter_response_values", "token_budget_microbatches", "unpack",
    "PromptSampler", "shard_for_rank",
    "TEMPLATES", "apply_template", "get_template", "register_template", "render_prompt", "render_text",
]
