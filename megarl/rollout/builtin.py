"""Builtin rollout engine: batched generation with a preallocated KV cache, pure torch.

Runs on CPU (tests, quickstart) and on one GPU (small runs). Architecture: `torch_model.DecoderLM`
(Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE, Qwen2-MoE), `torch_vlm.VisionLM` (Qwen2.5-VL) or
`torch_qwen3_vl.Qwen3VisionLM` (Qwen3-VL, Qwen3-VL-MoE); sampling: `sampling.py`.

Images and videos (vision-language models): `generate(..., images=[PromptImages | HF processor
dict | None per prompt])`; the tower runs once per prompt and modality at prefill, M-RoPE
positions as HF (`torch_vlm`), DeepStack features added in prefill (Qwen3-VL); samples keep their
images (`Sample.images`) for `continue_samples`.

Batching. Prompts are left-padded so every row writes the same cache slot at each decode step;
positions start at 0 at each row's first real token and pad keys are masked. With `n > 1` each
distinct prompt is prefilled once and its cache rows are repeated. Finished rows stay in the batch
(their tokens are ignored) until at least 1/8 of the rows are finished, then the batch is compacted,
so long-tail samples run in a small batch.

Log-probs. `Sample.logprobs[i]` is the log-probability of `response_ids[i]` under the distribution
it was sampled from (temperature, top-k, top-p applied and renormalised; FIRE's first token under
the FIRE distribution). Greedy (temperature 0) reports the unmodified log-softmax (temperature 1).

Finish reasons: "stop" (an EOS id from config.json, generation_config.json or the tokenizer, a
stop token id, or a stop string; the token that completes it is kept in `response_ids` and
`text`), "length" (`max_new_tokens` or the context length reached), "truncated" (T-PPO `window`
reached first; `continue_samples` resumes it under the current weights, re-prefilling prompt +
response).

Seeds: `seed` seeds a torch.Generator created for the call (the global RNG is not touched); the
draws depend on the batch, so a sample is reproducible for the same call, not across batchings.

Memory. The KV cache lives only for the duration of a generate call; its size (layers * 2 * rows
* (longest context + budget) * kv_heads * head_dim * dtype bytes) is checked against `kv_cache_gb`
before anything is allocated (KVCacheBudgetError above it) and kept in `kv_cache_bytes`.
`release_memory()` moves the weights to CPU on GPU (`discard_weights=True` frees them instead;
then `update_weights` must run after `resume_memory()` before the next generate). On CPU,
`release_memory()` keeps the weights in place unless `discard_weights=True`. Between release and
resume, generate and update_weights raise RuntimeError.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from megarl.weights.hf_reader import (
    eos_token_ids, has_tokenizer, iter_checkpoint_buckets, read_config)
from megarl.rollout.sampling import sample_tokens, segment_budget, token_samplers
from megarl.rollout.torch_model import (
    DecoderLM, KVCache, ModelArgs, check_kv_cache_budget, model_args_from_hf_config)
from megarl.rollout.torch_moe import RoutingTape, sample_routing
from megarl.weights.fp8_blocks import dequantized_stream
# registers the vision-language families of MODEL_FAMILIES (model_args_from_hf_config)
from megarl.rollout.torch_qwen3_vl import vision_lm_class
from megarl.rollout.torch_mla import past_last_layer  # (also registers deepseek_v3, kimi_k2, glm4_moe)
from megarl.rollout import torch_hybrid as _hybrid  # noqa: F401  (registers qwen3_next, qwen3_5, qwen3_5_moe)
from megarl.rollout.torch_vlm import check_images, hf_param_name
from megarl.rollout.types import PromptImages, Sample, SamplingParams

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# Checkpoint entries that are not parameters (old HF checkpoints stored the rotary table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_COMPACT_FRACTION = 8  # compact the batch once >= 1/8 of its rows are finished


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {sorted(_DTYPES)})")
    return _DTYPES[dtype]


@dataclass
class _Row:
    """One sequence being generated in this call."""

    response: list[int]  # response so far, including tokens of earlier segments
    budget: int  # new tokens allowed in this call
    window_limited: bool  # reaching the budget means "truncated", not "length"
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    context_routing: torch.Tensor | None = None  # MoE: [context tokens, layers, k] experts of the prefill
    routing: list[torch.Tensor] = field(default_factory=list)  # MoE: [layers, k] per forwarded new token


class BuiltinEngine:
    """RolloutEngine in pure torch. See the module docstring for semantics."""

    def __init__(self, config: Any, *, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", tokenizer: Any = None,
                 eos_token_ids: Sequence[int] | None = None, max_context: int | None = None,
                 kv_cache_gb: float | None = None):
        self.args: ModelArgs = model_args_from_hf_config(config)
        self.kv_cache_gb = kv_cache_gb  # GiB budget of one call's KV cache; None = no limit
        self.kv_cache_bytes = 0  # KV cache of the last generate / continue_samples call
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = [] if isinstance(config, ModelArgs) else _config_eos(config)
            eos_token_ids += _tokenizer_eos(tokenizer)
        self.eos_token_ids = list(dict.fromkeys(int(t) for t in eos_token_ids))
        self.max_context = min(max_context or self.args.max_position_embeddings,
                               self.args.max_position_embeddings)
        model_cls = DecoderLM if self.args.vision is None else vision_lm_class(self.args)
        self.model = model_cls.empty(self.args, self.dtype, self.device)
        self._shapes = {n: p.shape for n, p in self.model.named_parameters()}
        self._dtypes = {n: p.dtype for n, p in self.model.named_parameters()}  # a router bias stays float32
        self._loaded: set[str] = set()
        self.weight_version = 0
        self._released = False
        self._discarded = False
        # MoE: Sample.routed_experts = the experts of every prompt / response token (routing replay)
        self.record_routing = bool(self.args.num_experts)

    @classmethod
    def from_pretrained(cls, hf_dir: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu", tokenizer: Any = "auto",
                        max_context: int | None = None, kv_cache_gb: float | None = None) -> "BuiltinEngine":
        """Loads config.json + safetensors (single file or sharded with an index).

        tokenizer="auto" loads `AutoTokenizer.from_pretrained(hf_dir)` when tokenizer files are
        present; pass a tokenizer object or None to override.
        """
        config = read_config(hf_dir)
        if isinstance(tokenizer, str) and tokenizer == "auto":
            tokenizer = None
            if has_tokenizer(hf_dir):
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        eos = eos_token_ids(config, hf_dir) + _tokenizer_eos(tokenizer)
        engine = cls(config, dtype=dtype, device=device, tokenizer=tokenizer, eos_token_ids=eos,
                     max_context=max_context, kv_cache_gb=kv_cache_gb)
        engine.update_weights(iter_checkpoint_buckets(hf_dir))
        return engine

    # ------------------------------------------------------------------ weights and memory

    @property
    def weights_ready(self) -> bool:
        return self._loaded == set(self._shapes)

    def update_weights(self, stream: Iterable[list[tuple[str, torch.Tensor]]],
                       strict: bool = True) -> None:
        """Copies full HF-named tensors into the model; any order, any bucket split.

        strict: every parameter must appear in this stream (otherwise ValueError). With
        strict=False a partial update is allowed; generation still requires that every parameter
        was loaded at least once since construction (or since weights were discarded).
        """
        if self._released:
            raise RuntimeError("update_weights: engine memory is released; call resume_memory() first")
        params = dict(self.model.named_parameters())
        seen: set[str] = set()
        try:
            for bucket in dequantized_stream(stream):  # FP8 rollout weights: W = Q * S (megarl.weights.fp8_blocks)
                for name, tensor in bucket:
                    key = self._param_key(name)
                    if key is None:
                        continue
                    if key not in params:
                        raise ValueError(f"update_weights: unknown weight {name!r} for a "
                                         f"{self.args.model_type} model")
                    if tuple(tensor.shape) != tuple(params[key].shape):
                        raise ValueError(f"update_weights: {name!r} has shape "
                                         f"{tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
                    params[key].data.copy_(tensor)
                    seen.add(key)
        except BaseException:
            self._loaded.clear()  # weights are now a mix of versions: refuse to generate
            raise
        self._loaded |= seen
        missing = sorted(set(params) - seen)
        if strict and missing:
            self._loaded -= set(missing)
            raise ValueError(f"update_weights: {len(missing)} weights missing from the stream, "
                             f"e.g. {missing[:5]}")
        self.weight_version += 1

    def _param_key(self, name: str) -> str | None:
        if name.endswith(_IGNORED_SUFFIXES) or past_last_layer(name, self.args):
            return None
        if self.args.vision is not None:
            name = hf_param_name(name)
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

    def release_memory(self, discard_weights: bool = False) -> None:
        """Frees accelerator memory for training (weights to CPU on GPU, or dropped if asked)."""
        if self._released:
            return
        for param in self.model.parameters():
            if discard_weights:
                param.data = torch.empty(0, dtype=self.dtype, device=self.device)
            elif self.device.type != "cpu":
                param.data = param.data.to("cpu")
        if discard_weights:
            self._loaded.clear()
        self._released, self._discarded = True, discard_weights
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Undoes `release_memory`; after a discard, weights must be streamed again."""
        if not self._released:
            return
        for name, param in self.model.named_parameters():
            if self._discarded:
                param.data = torch.empty(self._shapes[name], dtype=self._dtypes[name], device=self.device)
            elif self.device.type != "cpu":
                param.data = param.data.to(self.device)
        self._released = self._discarded = False

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 images: Sequence[PromptImages | Any | None] | None = None) -> list[Sample]:
        """`sampling.n` samples per prompt, prompt-major order (Sample.index = prompt index).

        images: vision-language models only; one entry per prompt (module doc)."""
        self._check_call(sampling)
        prompts = [self._check_tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
        images = self._check_images(images, len(prompts))
        for i, p in enumerate(prompts):
            if len(p) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the engine context is "
                                 f"{self.max_context} tokens, which leaves no room for a response")
        rows = []
        for p in prompts:
            budget, window_limited = self._budget(len(p), 0, sampling)
            rows += [_Row([], budget, window_limited) for _ in range(sampling.n)]
        if prompts:
            self._run(prompts, sampling.n, rows, sampling, first_segment=True, images=images)
        samples = []
        for r, row in enumerate(rows):
            index = r // sampling.n
            samples.append(self._make_sample(prompts[index], row, index, meta={},
                                             images=images[index] if images else None))
        return samples

    def continue_samples(self, samples: Sequence[Sample], sampling: SamplingParams) -> list[Sample]:
        """Continues "truncated" samples under the current weights (T-PPO).

        The prompt and the response so far are prefilled again; new tokens and log-probs are
        appended. `max_new_tokens` bounds the whole response; `window` bounds this segment. FIRE
        does not apply (the first response token already exists). Inputs are not modified.
        """
        self._check_call(sampling)
        if sampling.n != 1:
            raise ValueError(f"continue_samples: SamplingParams.n must be 1 (got {sampling.n})")
        contexts, rows, runnable, context_images = [], [], [], []
        self._check_images([s.images for s in samples], len(samples))
        for i, s in enumerate(samples):
            if s.finish_reason != "truncated":
                raise ValueError(f"continue_samples: sample {i} has finish_reason "
                                 f"{s.finish_reason!r}; only 'truncated' samples can be continued")
            if len(s.logprobs) != len(s.response_ids):
                raise ValueError(f"continue_samples: sample {i} has {len(s.response_ids)} response "
                                 f"ids but {len(s.logprobs)} logprobs")
            prompt = self._check_tokens(s.prompt_ids, f"sample {i} prompt_ids")
            response = self._check_tokens(s.response_ids, f"sample {i} response_ids", allow_empty=True)
            budget, window_limited = self._budget(len(prompt) + len(response), len(response), sampling)
            row = _Row(list(response), max(budget, 0), window_limited)
            if budget <= 0:
                row.finish_reason = "length"
            else:
                contexts.append(prompt + response)
                context_images.append(s.images)
                runnable.append(row)
            rows.append(row)
        if contexts:
            self._run(contexts, 1, runnable, sampling, first_segment=False,
                      images=context_images if self.args.vision is not None else None)
        out = []
        for s, row in zip(samples, rows):
            cont = self._make_sample(list(s.prompt_ids), row, s.index, meta=dict(s.meta), images=s.images)
            cont.response_ids = list(s.response_ids) + cont.response_ids
            cont.logprobs = list(s.logprobs) + cont.logprobs
            cont.text = self._decode(cont.response_ids)
            out.append(cont)
        return out

    def _check_call(self, sampling: SamplingParams) -> None:
        sampling.validate()
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; pass tokenizer= to the engine")
        if self._released:
            raise RuntimeError("engine memory is released; call resume_memory() before generating")
        if not self.weights_ready:
            missing = sorted(set(self._shapes) - self._loaded)
            raise RuntimeError(f"engine has no complete weights ({len(missing)} never loaded, e.g. "
                               f"{missing[:3]}); call update_weights() or use from_pretrained()")

    def _check_tokens(self, ids: Any, what: str, allow_empty: bool = False) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | torch.Tensor):
            raise ValueError(f"{what}: expected a list of token ids, got {type(ids).__name__}")
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not ids and not allow_empty:
            raise ValueError(f"{what} is empty")
        vocab = self.args.vocab_size
        for j, t in enumerate(ids):
            try:
                ids[j] = t = operator.index(t)
            except TypeError:
                raise ValueError(f"{what}: token {t!r} at position {j} is not an integer") from None
            if not 0 <= t < vocab:
                raise ValueError(f"{what}: token {t} at position {j} is outside the vocabulary "
                                 f"[0, {vocab})")
        return ids

    def _check_images(self, images: Any, n_prompts: int) -> list[PromptImages | None] | None:
        return check_images(self.args, images, n_prompts)

    def _budget(self, context_len: int, done: int, sampling: SamplingParams) -> tuple[int, bool]:
        return segment_budget(context_len, done, sampling, self.max_context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _make_sample(self, prompt: list[int], row: _Row, index: int, meta: dict,
                     images: PromptImages | None = None) -> Sample:
        meta.setdefault("weight_versions", [])
        meta["weight_versions"] = list(meta["weight_versions"]) + [self.weight_version]
        routed = None
        if row.context_routing is not None:  # prompt + whole response (earlier segments: in the context)
            routed = sample_routing(row.context_routing, row.routing, len(prompt) + len(row.response))
        return Sample(prompt_ids=list(prompt), response_ids=row.new_ids,
                      logprobs=row.new_logprobs, finish_reason=row.finish_reason,
                      text=self._decode(row.new_ids), index=index, meta=meta, routed_experts=routed,
                      images=images)

    def _stop_hit(self, row: _Row, token: int, stop_ids: set[int], stops: list[str],
                  tail: int) -> bool:
        if token in stop_ids:
            return True
        if not stops:
            return False
        text = self.tokenizer.decode(row.response[-tail:], skip_special_tokens=False)
        before = self.tokenizer.decode(row.response[-tail:-1], skip_special_tokens=False)
        return any(s in text and s not in before for s in stops)

    def _prefill(self, contexts: list[list[int]], width: int, cache: KVCache,
                 tape: RoutingTape | None = None, vision: list | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Writes every context right-aligned into cache slots [width - len, width) and returns the
        logits [B, V] of its last position. Rows are prefilled in groups of similar length (powers
        of two), each left-padded only to its own longest context: a T-PPO window mixes short
        prompts with long carried responses, and one padded batch would compute mostly padding.
        Slots left of a group's width are zeroed (`KVCache.write_rows`).
        With a routing tape, also each context's experts [len, layers, k] (else Nones). `vision`
        (vision-language models): each context's `torch_vlm.VisionContext` (M-RoPE positions,
        image / video embeddings, DeepStack features)."""
        dev, lens = self.device, [len(c) for c in contexts]
        routing: list[torch.Tensor | None] = [None] * len(contexts)
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            groups.setdefault((n - 1).bit_length(), []).append(i)
        logits = None
        for members in groups.values():
            L = max(lens[i] for i in members)
            pads = torch.tensor([L - lens[i] for i in members], device=dev)
            tokens = torch.zeros(len(members), L, dtype=torch.long)
            for r, i in enumerate(members):
                tokens[r, L - lens[i]:] = torch.tensor(contexts[i])
            valid = torch.arange(L, device=dev)[None] >= pads[:, None]
            positions = (torch.arange(L, device=dev)[None] - pads[:, None]).clamp(min=0)
            causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
            diag = torch.eye(L, dtype=torch.bool, device=dev)  # pad queries see themselves
            mask = (causal[None] & valid[:, None, :]) | diag[None]
            part = KVCache.allocate(self.args, len(members), L, self.dtype, dev)
            extra = {}
            if vision is not None:
                positions, extra = self.model.prefill_inputs(tokens.to(dev), [vision[i] for i in members])
            out = self.model(tokens.to(dev), positions, part, 0, mask[:, None], **extra)
            if tape is not None:
                rec = tape.take()
                rec = rec.view(len(members), L, *rec.shape[1:])
                for r, i in enumerate(members):
                    routing[i] = rec[r, L - lens[i]:]
            idx = torch.tensor(members, device=dev)
            cache.write_rows(idx, part, width)
            if logits is None:
                logits = out.new_empty(len(contexts), out.shape[-1])
            logits[idx] = out
        return logits, routing

    @torch.inference_mode()
    def _run(self, contexts: list[list[int]], repeat: int, rows: list[_Row],
             sampling: SamplingParams, first_segment: bool,
             images: list[PromptImages | None] | None = None) -> None:
        """Generates for `rows` (row r continues contexts[r // repeat]); fills the rows in place.
        images: one entry per context (vision-language models; None for text-only models)."""
        dev = self.device
        first_sampler, sampler = token_samplers(sampling)
        if not first_segment:
            first_sampler = sampler
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        generator = torch.Generator(device=dev).manual_seed(seed)
        stop_ids = set(sampling.stop_token_ids) | set(self.eos_token_ids)
        tail = 4 * max((len(s) for s in sampling.stop), default=0) + 8

        lens = torch.tensor([len(c) for c in contexts])
        prompt_len = int(lens.max())
        max_steps = max(row.budget for row in rows)
        pads = (prompt_len - lens).to(dev)
        key_valid = torch.arange(prompt_len + max_steps, device=dev)[None] >= pads[:, None]

        self.kv_cache_bytes = check_kv_cache_budget(self.args, len(rows), prompt_len + max_steps, self.dtype,
                                                    self.kv_cache_gb)
        cache = KVCache.allocate(self.args, len(contexts), prompt_len + max_steps, self.dtype, dev)
        # vision-language models: M-RoPE positions and image embeddings (the tower runs once per context)
        vision = self.model.prepare_contexts(contexts, images) if self.args.vision is not None else None
        tape = RoutingTape(self.model) if self.record_routing and sampling.return_routing else None
        try:
            self._generate_rows(contexts, repeat, rows, sampling, first_sampler, sampler, generator, stop_ids, tail,
                                lens, prompt_len, max_steps, key_valid, cache, tape, vision)
        finally:
            if tape is not None:
                tape.close()

    def _generate_rows(self, contexts, repeat, rows, sampling, first_sampler, sampler, generator, stop_ids, tail,
                       lens, prompt_len, max_steps, key_valid, cache, tape, vision=None) -> None:
        dev = self.device
        logits, context_routing = self._prefill(contexts, prompt_len, cache, tape, vision)
        if tape is not None:
            for r, row in enumerate(rows):
                row.context_routing = context_routing[r // repeat]
        next_pos = lens.to(dev)
        if vision is not None:  # M-RoPE: continue at each context's max position + 1 (HF rope_deltas)
            next_pos = next_pos + torch.tensor([v.delta for v in vision], device=dev)
        if repeat > 1:
            cache.repeat_rows(repeat)
            logits, key_valid, next_pos = (t.repeat_interleave(repeat, dim=0)
                                           for t in (logits, key_valid, next_pos))

        active = list(range(len(rows)))  # batch slot -> row index
        alive = [True] * len(rows)
        for step in range(max_steps):
            token_t, logprob_t = sample_tokens(logits, first_sampler if step == 0 else sampler,
                                               generator)
            appended = list(alive)  # slots whose row gets this step's token (forwarded below)
            for b, (tok, lp) in enumerate(zip(token_t.tolist(), logprob_t.tolist())):
                if not alive[b]:
                    continue
                row = rows[active[b]]
                row.new_ids.append(tok)
                row.new_logprobs.append(lp)
                row.response.append(tok)
                if self._stop_hit(row, tok, stop_ids, sampling.stop, tail):
                    row.finish_reason = "stop"
                elif len(row.new_ids) == row.budget:
                    row.finish_reason = "truncated" if row.window_limited else "length"
                alive[b] = row.finish_reason is None
            n_alive = sum(alive)
            if n_alive == 0:
                break
            if (len(alive) - n_alive) * _COMPACT_FRACTION >= len(alive):
                keep = [b for b, a in enumerate(alive) if a]
                keep_t = torch.tensor(keep, device=dev)
                cache.select_rows(keep_t)
                key_valid, next_pos, token_t = (t.index_select(0, keep_t)
                                                for t in (key_valid, next_pos, token_t))
                active = [active[b] for b in keep]
                alive = [True] * len(keep)
                appended = [True] * len(keep)
            slot = prompt_len + step
            logits = self.model(token_t[:, None], next_pos[:, None], cache, slot,
                                key_valid[:, None, None, :slot + 1])
            next_pos = next_pos + 1
            if tape is not None:
                rec = tape.take()
                for b, got in enumerate(appended):
                    if got:
                        rows[active[b]].routing.append(rec[b])


def _tokenizer_eos(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [int(eos)] if isinstance(eos, int) else []


def _config_eos(config: Any) -> list[int]:
    cfg = config if isinstance(config, dict) else config.to_dict()
    return eos_token_ids(cfg)
