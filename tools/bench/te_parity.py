"""Transformer Engine spec == local spec: logits and weight gradients of the same weights on the
packed THD micro-batches megarl trains on, each against a float32 reference.

    python -m tools.bench.te_parity --shapes tiny,0.5b,1.5b --json parity.json     # one GPU
    python -m tools.bench.te_parity --shapes tiny --impls local                      # CPU: the path itself

Per shape (tools/bench/train.py's Qwen2.5 shapes; tiny: 2 layers, hidden 128): random weights
(megatron's init for the Qwen2.5 shapes; tiny: norms in [0.5, 1.5), the rest N(0, 0.1^2), so a
wrong mapping or kernel shows) are written once as HF safetensors and loaded into every build, the
way a run loads a model. A step batch of sequences of mixed lengths (10% prompt) is cut by
`TrainModel.microbatches` into token-budget micro-batches, packed THD rows padded as the model's
token layout says (cu_seqlens_padded), exactly what training feeds the model. Per build:

- the full logits of the first `--logit-rows` packed positions of every micro-batch, and the
  log-prob of every response token (`TrainModel.forward_only`);
- the weight gradients of the token-mean NLL of the response tokens (`TrainModel.run`, DDP's fp32
  main_grad), in HF naming (megarl.models.bridge: TE's fused layer-norm + linear weights and the
  local spec's separate ones land on the same HF tensors).

Builds: the reference is the local spec in float32 (at the tiny shape checked against HF
transformers' float32 gradients of the same loss, sequence by sequence: within 1e-4, and under the
same HF names); the candidates are the local spec and the TE
spec in bf16. Reported per candidate: relative error ||x - ref|| / ||ref|| of the logits, the
log-probs and the gradients (all tensors concatenated; and the worst single tensor), and TE's
attention backend as TE selected it.

Pass: TE's error <= 2 x the local spec's bf16 error + 1e-3 for the logits, log-probs and
gradients. Why this bound: both run bf16 operands (unit roundoff 2^-9 ~ 2e-3 per rounding) with
float32 accumulation, so each is off the float32 reference by bf16 rounding grown over the
layers; what is exact enough for the local spec is exact enough for TE, and TE's fused kernels
(cuDNN attention, layer norm fused into the next GEMM) round in other places and orders, which the
factor 2 and the 1e-3 allow. A wrong weight mapping, mask or sequence boundary gives errors of
order 1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

FACTOR, SLACK = 2.0, 1e-3


def relative_error(x, ref) -> float:
    """||x - ref|| / ||ref|| over all elements (float64 sums)."""
    num = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(x, ref))
    den = sum(float(b.double().norm()) ** 2 for b in ref)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def verdict(te: dict, local: dict) -> tuple[bool, list[str]]:
    """TE's errors against the bound of the module docstring; (ok, what failed)."""
    bad = []
    for key in ("logits", "logprobs", "grads"):
        limit = FACTOR * local[key] + SLACK
        if not math.isfinite(te[key]) or te[key] > limit:
            bad.append(f"{key} {te[key]:.3g} > {limit:.3g}")
    return not bad, bad


def _randomize(chunks, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                v = torch.rand(p.shape, generator=gen) + 0.5 if "norm" in name else torch.randn(p.shape, generator=gen) * 0.1
                p.copy_(v)


def write_weights(shape: str, out: Path, max_len: int, seed: int = 0):
    """Random weights of `shape` as an HF checkpoint in `out` (see the module docstring); returns the HF config."""
    import torch

    from megarl.models import build_model
    from megarl.weights import save_hf_checkpoint, stream_hf_weights
    from tools.bench.train import hf_config

    cfg = hf_config(shape, max_len)
    torch.manual_seed(seed)
    chunks = build_model(cfg, dtype="fp32", impl="local", seed=seed)
    if shape == "tiny":
        _randomize(chunks, seed)
    save_hf_checkpoint(stream_hf_weights(chunks, cfg), out, hf_config=cfg)
    del chunks
    return cfg


def make_batch(vocab: int, tokens: int, microbatches: int, max_seq: int, seed: int):
    """Sequences of lengths drawn in [max_seq / 16, max_seq] filling about `microbatches` x `tokens`."""
    from megarl.trainer.batch import StepBatch, Trajectory

    rng = random.Random(seed)
    trajs, total = [], 0
    while total < tokens * microbatches - max_seq:
        n = rng.randint(max(4, max_seq // 16), max_seq)
        ids = [rng.randrange(vocab) for _ in range(n)]
        p = max(1, n // 10)
        trajs.append(Trajectory(uid=str(len(trajs)), prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=[],
                                finish_reason="stop"))
        total += n
    return StepBatch.from_trajectories(trajs)


def measure(cfg, weights: Path, impl: str, dtype: str, batch, tokens: int, logit_rows: int) -> dict:
    """Logits, log-probs and HF-named gradients of one build (see the module docstring)."""
    import torch

    from megarl.config.schema import OptimConfig
    from megarl.models.bridge import merge_shards, param_maps
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import load_hf_weights

    optim = OptimConfig(lr=0.0, weight_decay=0.0, max_tokens_per_microbatch=tokens, use_distributed_optimizer=True)
    model = TrainModel(cfg, optim, dtype=dtype, impl=impl, total_steps=1, seed=0)
    load_hf_weights(model.chunks, weights)
    logits = []

    def keep(mb, output):
        flat = output.reshape(-1, output.shape[-1])
        logits.append(flat[:logit_rows].float().cpu())
        return mb.log_probs(output)

    logprobs = model.forward_only(batch, keep).float().cpu()
    mask = batch.response_mask
    n_tokens = float(mask.sum())

    def nll(mb, output):
        loss = -(mb.log_probs(output) * mb.data.response_mask).sum() / n_tokens
        return loss, {"nll": loss.detach()}

    for c in model.chunks:
        c.zero_grad_buffer()
    model.run(model.microbatches(batch), nll, forward_only=False)
    grads = {}
    for chunk, module in zip(model.chunks, model.modules):
        for pm, p in param_maps(module, module.arch_spec):
            if pm.export and p.requires_grad:
                for name, g in zip(pm.hf_names, merge_shards(pm, [p.main_grad.detach()], module.arch_spec)):
                    grads[name] = g.float().cpu()
    out = {"logits": logits, "logprobs": logprobs * mask, "grads": grads,
           "microbatches": len(model.microbatches(batch)), "backend": te_attention_backend() if impl != "local" else ""}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def te_attention_backend() -> str:
    """The attention backend TE selected for its last call (transformer_engine 2.11's cache)."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends as b
    except ImportError:
        return "n/a"
    params = b.get("attention_params")
    fmt = getattr(params, "qkv_format", "?")
    if b.get("use_flash_attention"):
        return f"FlashAttention ({fmt})"
    if b.get("use_fused_attention"):
        return f"FusedAttention sub-backend {int(b.get('fused_attention_backend') or 0)} ({fmt})"
    return f"UnfusedDotProductAttention ({fmt})" if b.get("use_unfused_attention") else "none"


def hf_gradients(weights: Path, batch) -> dict:
    """HF transformers' float32 gradients of the same loss, sequence by sequence (an independent
    check of the reference and of the HF naming of its gradients)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    n_tokens = float(batch.response_mask.sum())
    for prompt, response in zip(batch.prompt_ids, batch.response_ids):
        p, r = len(prompt), len(response)
        ids = torch.tensor([list(prompt) + list(response)])
        logp = model(ids).logits[0, p - 1 : p + r - 1].float().log_softmax(-1)
        loss = -logp.gather(-1, ids[0, p:, None]).sum() / n_tokens
        loss.backward()
    return {n: q.grad.detach().float() for n, q in model.named_parameters() if q.grad is not None}


def compare(run: dict, ref: dict) -> dict:
    worst = max(ref["grads"], key=lambda k: relative_error([run["grads"][k]], [ref["grads"][k]]))
    return {"logits": relative_error(run["logits"], ref["logits"]),
            "logprobs": relative_error([run["logprobs"]], [ref["logprobs"]]),
            "grads": relative_error([run["grads"][k] for k in ref["grads"]], list(ref["grads"].values())),
            "worst_grad": worst, "worst_grad_error": relative_error([run["grads"][worst]], [ref["grads"][worst]]),
            "backend": run["backend"], "microbatches": run["microbatches"]}


def parity(shape: str, impls: list[str], tokens: int, microbatches: int, logit_rows: int, work: Path) -> dict:
    t0 = time.perf_counter()
    max_seq = 200 if shape == "tiny" else 1536
    cfg = write_weights(shape, work / shape, max(tokens, max_seq))
    batch = make_batch(cfg.vocab_size, tokens, microbatches, min(max_seq, tokens), seed=1)
    ref = measure(cfg, work / shape, "local", "fp32", batch, tokens, logit_rows)
    row = {"shape": shape, "sequences": len(batch), "tokens": int(sum(batch.lengths)), "candidates": {}}
    if shape == "tiny":  # the reference itself against HF transformers (cheap at this size)
        hf = hf_gradients(work / shape, batch)
        missing = sorted(set(hf) ^ set(ref["grads"]))
        row["reference_vs_hf_grads"] = (relative_error([ref["grads"][k] for k in hf], list(hf.values()))
                                        if not missing else f"names differ: {missing[:4]}")
    for impl in impls:
        run = measure(cfg, work / shape, impl, "bf16", batch, tokens, logit_rows)
        row["candidates"][impl] = compare(run, ref)
        del run
    hf_error = row.get("reference_vs_hf_grads", 0.0)
    if not isinstance(hf_error, float) or hf_error > 1e-4:
        row["status"] = f"FAIL: the fp32 reference's gradients differ from HF transformers' ({hf_error})"
    elif "transformer_engine" in impls and "local" in impls:
        ok, bad = verdict(row["candidates"]["transformer_engine"], row["candidates"]["local"])
        row["status"] = "ok" if ok else "FAIL: " + "; ".join(bad)
    else:
        row["status"] = "ok (no TE: local only)"
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny,0.5b,1.5b")
    p.add_argument("--impls", default="local,transformer_engine", help="bf16 candidates against the fp32 local spec")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (the trainer's budget)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--logit-rows", type=int, default=512, help="packed positions per micro-batch whose full logits are compared")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tools.bench.train import SHAPES

    bad = sorted(set(args.shapes.split(",")) - set(SHAPES)) + sorted(set(args.impls.split(",")) - {"local", "transformer_engine"})
    if bad:
        p.error(f"unknown shapes / impls {bad} (shapes {sorted(SHAPES)}; impls local, transformer_engine)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=0)
    rows, failed = [], False
    impls = [i for i in args.impls.split(",") if i]
    with tempfile.TemporaryDirectory(prefix="te-parity-") as work:
        for shape in [s for s in args.shapes.split(",") if s]:
            try:
                rows.append(parity(shape, impls, args.tokens, args.microbatches, args.logit_rows, Path(work)))
            except Exception as err:  # noqa: BLE001 - reported; the next shape runs
                rows.append({"shape": shape, "status": f"error: {type(err).__name__}: {str(err)[:300]}"})
            failed |= not rows[-1]["status"].startswith("ok")
            print("parity " + json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "bound": f"TE <= {FACTOR} x local bf16 + {SLACK}"}, indent=2))
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
