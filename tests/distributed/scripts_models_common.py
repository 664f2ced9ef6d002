"""Tiny random HF models of every supported dense family, for the model/weights tests, and the
pieces every HF <-> Megatron comparison script shares: random weights with teeth, a model built
and loaded from HF files, logit and log-prob comparisons, the bit-exact weight-stream round trip.

Vocabularies (150, 130) are not multiples of 128, so Megatron's TP vocab padding is exercised.
Weights are drawn with larger scales than HF's init (std 0.02 would make every logit ~0 and the
equivalence checks toothless).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def tiny_config(family: str):
    if family == "qwen2":
        return transformers.Qwen2Config(vocab_size=150, tie_word_embeddings=False, rope_theta=1000.0,
                                        **COMMON)
    if family == "qwen3":  # head_dim 24 != hidden / heads = 16
        return transformers.Qwen3Config(vocab_size=150, head_dim=24, tie_word_embeddings=False, **COMMON)
    if family == "llama3":  # llama3 RoPE with non-default low/high factors and original length
        return transformers.LlamaConfig(
            vocab_size=150, tie_word_embeddings=False, rope_theta=100.0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 2.0, "original_max_position_embeddings": 16}, **COMMON)
    if family == "llama_tied":
        return transformers.LlamaConfig(vocab_size=130, tie_word_embeddings=True, **COMMON)
    raise ValueError(family)


FAMILIES = ("qwen2", "qwen3", "llama3", "llama_tied")


@torch.no_grad()
def save_random(build, path: str | Path, seed: int, norm=lambda name: "norm" in name):
    """torch.manual_seed(seed), model = build(), every parameter drawn with larger scales than HF's
    init (`norm(name)`: U(0.5, 1.5); the rest N(0, 0.15), 1-D ones N(0, 0.1)), saved at path by HF;
    returns the model."""
    torch.manual_seed(seed)
    model = build()
    for name, p in model.named_parameters():
        if norm(name):
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    return model


def make_tiny_hf(family: str, path: str | Path, seed: int = 0, hidden: int | None = None,
                 layers: int | None = None) -> Path:
    """Creates and saves a random HF model; returns its directory."""
    cfg = tiny_config(family)
    if hidden:
        cfg.hidden_size, cfg.intermediate_size = hidden, hidden * 2
        cfg.head_dim = hidden // cfg.num_attention_heads
    if layers:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = ["full_attention"] * layers
    save_random(lambda: transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), path, seed)
    return Path(path)


@torch.no_grad()
def hf_logits(path: str | Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model(ids).logits.float()


def loaded(cfg, path: str | Path, **kwargs) -> list:
    """The Megatron model of `cfg` (megarl.models.build_model with kwargs), its weights read from
    the HF files at path."""
    from megarl.models import build_model
    from megarl.weights import load_hf_weights

    model = build_model(cfg, **kwargs)
    load_hf_weights(model, path)
    return model


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def logits_vs(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Megatron logits against the HF reference: max |difference|, shape, and the reference's
    spread (so a test can see the comparison has teeth)."""
    return {"max_abs_diff": max_abs(out, ref), "shape": list(out.shape), "ref_std": float(ref.std())}


def roundtrip(model, cfg, original: dict, bucket_bytes: int) -> dict:
    """HF -> Megatron -> stream -> HF: the streamed tensors against the HF file's (`original`),
    torch.equal, agreed over all ranks (every rank receives the whole stream)."""
    from megarl.parallel.distributed import device
    from megarl.weights import stream_hf_weights

    got, buckets = {}, 0
    for bucket in stream_hf_weights(model, cfg, bucket_bytes=bucket_bytes):
        buckets += 1
        for name, t in bucket:
            got[name] = t.cpu().clone()
    exact = set(got) == set(original) and all(torch.equal(got[k], original[k]) for k in original)
    ok = torch.tensor([int(exact)], device=device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"exact_all_ranks": bool(ok.item()), "keys": len(got), "buckets": buckets,
            "missing": sorted(set(original) - set(got))[:5], "extra": sorted(set(got) - set(original))[:5]}


def check_layout(cfg, path: str | Path, forward, ref: torch.Tensor, original: dict, bucket_bytes: int):
    """One model at the current layout: `loaded` from the HF files at path, its logits
    `forward(model)` against ref (`logits_vs`) and its stream against the file's tensors
    (`roundtrip`). Returns (model, logits, logits_vs, roundtrip)."""
    model = loaded(cfg, path)
    out = forward(model)
    return model, out, logits_vs(out, ref), roundtrip(model, cfg, original, bucket_bytes)


@torch.no_grad()
def perturb(model) -> None:
    """Deterministic multiplicative noise (as training would change the weights), the same per
    name on every TP rank, so replicated parameters stay identical across TP ranks."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen).to(p.device))


def tee(stream, sink: dict, counter: list | None = None):
    """Passes a weight stream's buckets on, keeping a copy of each tensor in `sink` (and each
    bucket's size in `counter`)."""
    for bucket in stream:
        if counter is not None:
            counter.append(len(bucket))
        for name, t in bucket:
            sink[name] = t.cpu().clone()
        yield bucket


def streamed(model, cfg) -> dict:
    """Every HF tensor the weight stream of `model` (its chunks) sends, by name, as a host copy."""
    from megarl.weights import stream_hf_weights

    return {name: t.detach().cpu().clone() for bucket in stream_hf_weights(model, cfg) for name, t in bucket}


def padded_rows(samples) -> torch.Tensor:
    """[n, width]: each sample's prompt + response, right-padded with token 0."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (width - len(s)) for s in seqs])


def response_logprobs(logits: torch.Tensor, samples) -> list[list[float]]:
    """Log-probs of each sample's response tokens under `logits` of its `padded_rows` row."""
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for row, s in enumerate(samples):
        start = len(s.prompt_ids)
        pos = torch.arange(start - 1, start - 1 + len(s.response_ids))
        out.append(logp[row, pos, torch.tensor(s.response_ids)].tolist())
    return out


def max_logprob_diff(samples, ref) -> float:
    """max |sample log-prob - reference log-prob| over every response token."""
    return max(abs(a - b) for s, r in zip(samples, ref) for a, b in zip(s.logprobs, r))
