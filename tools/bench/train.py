"""Actor-step benchmark: tokens/s, MFU and peak memory of megarl's training step on one GPU.

    python -m tools.bench.train --shape 0.5b                 # 4k and 16k tokens per micro-batch, local + TE
    python -m tools.bench.train --shape 3b --seq 16384 --impl te --recompute selective
    torchrun --nproc-per-node 8 -m tools.bench.train --shape 1.5b --tp 2
    python -m tools.bench.train --shape tiny --seq 256       # CPU: runs, MFU n/a
    python -m tools.bench.train --shape 1.5b --impl te --fp8 none,tensorwise   # TE bf16 and FP8 rows

What is timed (per configuration: layer implementation x tokens per micro-batch):
- `step`: one actor update exactly as the RL loop runs it: `TrainModel.train_step` (megatron
  `forward_backward_func` over `--microbatches` packed micro-batches of `--seq` tokens, megatron DDP
  grad reduction, distributed Adam step) with `megarl.trainer.rl.actor_loss_fn` (DAPO settings:
  clipped surrogate with clip-higher 0.28, token-mean, entropy computed without gradient) on a
  `StepBatch` of random tokens: sequences of `--sample-len` tokens (10% prompt, 90% response),
  `seq // sample_len` of them per micro-batch, packed in one THD row (local spec: megarl's
  blockwise attention, megarl.models.attention; TE spec: TE's fused attention).
- `logprob`: the old-log-prob pass (`TrainModel.forward_only` via `rl.compute_log_probs`).
Each is run `--warmup` times, then timed over `--steps` runs (CUDA synchronised).

The model is a randomly initialised Qwen2.5 shape built from a `transformers.Qwen2Config` (no
download): tiny, 0.5b, 1.5b, 3b (hidden / layers / heads / KV heads / FFN / vocab of the Qwen2.5
releases, tied embeddings). Parameters bf16 on GPU (fp32 main params and Adam state in the
distributed optimizer, fp32 grad reduction), fp32 on CPU.

FLOPs (what MFU counts), for a micro-batch holding sequences of lengths L_i (N = sum L_i tokens):

    train step   F = 6 * P * N + 12 * n_layers * (n_heads * head_dim) * sum_i L_i^2
    forward only F = 2 * P * N +  4 * n_layers * (n_heads * head_dim) * sum_i L_i^2
    P = n_layers * (h * n_heads*d  +  2 * h * n_kv*d  +  n_heads*d * h  +  3 * h * ffn)  +  h * V

P is the weights that take part in a matrix multiply per token (Q, K, V, O projections, the
gated MLP's three matrices, and the output layer h x V, counted once even when tied to the
embedding); the embedding lookup, norms, biases, RoPE, softmax and the loss are not counted. The
attention term counts the whole L x L score matrix (QK^T and AV, forward 4 * L^2 * n_heads*d per
layer, backward twice that): the PaLM / Megatron-LM convention, without a causal discount (the
kernels compute about half of it under the causal mask). Activation recomputation is not counted.
A step's FLOPs are summed over its micro-batches.

FP8 rows (`--fp8 RECIPE`, TE spec only: `fp8="hybrid"` with that `fp8_recipe`) count the same
model FLOPs F against the same bf16 peak: their MFU is bf16-equivalent (an FP8 GEMM's own peak is
twice the bf16 one), so FP8 MFU / bf16 MFU = the FP8 speed-up.

MFU = F / (step seconds * tp) / peak, peak = dense bf16 tensor-core FLOP/s of the GPU:
H100 SXM / H200 / H800 / GH200 989 TFLOP/s, H100 NVL 835, H100 PCIe 756, A100 / A800 312,
L40S 362, B200 2250 (`--peak-tflops` overrides; unknown GPUs and CPU give MFU n/a).
tokens/s is per GPU: N per step / step seconds / tp (each DP rank trains its own batch).

Prints a table and one line per configuration:
`bench impl=<local|te> attn=<kernel> precision=<bf16|fp8 recipe> shape=<s> seq=<tokens> ... tokens_per_s=<float>
mfu=<float|n/a> peak_mem_gib=<float|n/a>`;
a configuration that runs out of GPU memory is reported as OOM and the next one runs.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.train`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import gc
import json
import math
import random
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from tools._options import key_values


# Qwen2.5 release dimensions (config.json of Qwen/Qwen2.5-{0.5B,1.5B,3B}); tiny is for CPU tests.
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}

# dense bf16 tensor-core peak, TFLOP/s; the first substring of the device name that matches wins
PEAK_BF16_TFLOPS = [
    ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("GH200", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("B200", 2250.0),
]


def hf_config(shape: str, max_len: int):
    import transformers

    return transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=max(32768, max_len),
                                    rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)


def matmul_params(cfg) -> int:
    """P of the docstring: weights in a matrix multiply per token (output layer counted once)."""
    h, L, ffn, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return L * (h * q + 2 * h * kv + q * h + 3 * h * ffn) + h * V


def step_flops(cfg, seq_lengths: list[int], train: bool) -> float:
    """FLOPs of the docstring for sequences of these lengths (all micro-batches of a step)."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = sum(seq_lengths)
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * d * sum(L * L for L in seq_lengths)
    return (6.0 * matmul_params(cfg) * n + 12.0 * attn) if train else (2.0 * matmul_params(cfg) * n + 4.0 * attn)


def peak_flops(override_tflops: float | None) -> tuple[float | None, str]:
    import torch

    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    if not torch.cuda.is_available():
        return None, "cpu"
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s bf16 dense"
    return None, f"{name}: peak unknown (use --peak-tflops)"


@dataclass
class Row:
    impl: str
    attn: str  # the local attention's kernel (megarl.models.attention_kernels): auto, varlen, sdpa, blockwise
    shape: str
    seq: int
    sample_len: int
    microbatches: int
    status: str = "ok"  # ok | OOM | error: ...
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    tflops: float = math.nan
    mfu: float | None = None
    logprob_s: float = math.nan
    logprob_tokens_per_s: float = math.nan
    logprob_mfu: float | None = None
    peak_mem_gib: float | None = None
    static_mem_gib: float | None = None
    precision: str = "bf16"  # bf16, or the FP8 recipe (TE spec)

    def line(self) -> str:
        f = lambda x, fmt: "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)
        return (f"bench impl={self.impl} attn={self.attn} precision={self.precision} shape={self.shape} seq={self.seq} "
                f"sample_len={self.sample_len} "
                f"microbatches={self.microbatches} status={self.status.split(':')[0]} "
                f"step_s={f(self.step_s, '.4f')} tokens_per_s={f(self.tokens_per_s, '.1f')} "
                f"tflops={f(self.tflops, '.2f')} mfu={f(self.mfu, '.4f')} "
                f"logprob_tokens_per_s={f(self.logprob_tokens_per_s, '.1f')} "
                f"logprob_mfu={f(self.logprob_mfu, '.4f')} peak_mem_gib={f(self.peak_mem_gib, '.2f')}")


def make_batch(cfg, seq: int, sample_len: int, microbatches: int, seed: int):
    """A StepBatch of random sequences of `sample_len` tokens (10% prompt), `seq // sample_len`
    per micro-batch, with loss masks, advantages and (placeholder) old log-probs set."""
    import torch

    from megarl.trainer.batch import StepBatch, Trajectory

    rng = random.Random(seed)
    prompt = max(1, sample_len // 10)
    n = (seq // sample_len) * microbatches
    trajs = []
    for i in range(n):
        ids = [rng.randrange(cfg.vocab_size) for _ in range(sample_len)]
        trajs.append(Trajectory(uid=f"p{i // 4}", prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                                rollout_logprobs=[], finish_reason="stop", score=float(i % 2), acc=bool(i % 2)))
    batch = StepBatch.from_trajectories(trajs)
    gen = torch.Generator().manual_seed(seed)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    return batch


def rl_config(sample_len: int):
    from megarl.config.schema import MegaRLConfig

    cfg = MegaRLConfig()
    cfg.algorithm.clip_low, cfg.algorithm.clip_high = 0.2, 0.28  # DAPO clip-higher
    cfg.algorithm.loss_agg = "token-mean"
    cfg.rollout.max_new_tokens = sample_len
    return cfg


def model_options(recompute: str | None, fp8: str = "bf16", extra: dict | None = None) -> dict | None:
    """TransformerConfig overrides: recomputation, FP8 (hybrid format, `fp8` the recipe) and `extra`
    (--model-option KEY=VALUE, e.g. a CUDA-graph setting to try)."""
    out: dict = {}
    if recompute == "selective":
        out["recompute_granularity"] = "selective"
    elif recompute == "full":
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8 != "bf16":
        out.update(fp8="hybrid", fp8_recipe=fp8)
    out.update(extra or {})
    return out or None


def parse_options(items: list[str] | None) -> dict:
    """--model-option KEY=VALUE strings -> TransformerConfig overrides (VALUE parsed as JSON when it is JSON)."""
    return key_values(items, "--model-option")


def configurations(impls: list[str], attns: list[str], precisions: list[str], seqs: list[int]) -> list[tuple]:
    """(impl, attn, precision, seq) rows to run: attention kernels are the local spec's, FP8 the TE spec's."""
    return [(i, a, p, s) for i in impls for a in (attns if i == "local" else ["auto"])
            for p in (precisions if i == "te" else ["bf16"]) for s in seqs]


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / max(1, steps)


def bench_one(args, impl: str, attn: str, seq: int, peak: float | None, precision: str = "bf16") -> Row:
    from megarl.models.attention_kernels import forced_kernel

    with forced_kernel(attn):
        return _bench_one(args, impl, attn, seq, peak, precision)


def _bench_one(args, impl: str, attn: str, seq: int, peak: float | None, precision: str = "bf16") -> Row:
    import torch
    from megatron.core import parallel_state as ps

    from megarl.config.schema import OptimConfig
    from megarl.trainer import rl
    from megarl.trainer.train_model import TrainModel

    cuda = torch.cuda.is_available()
    sample_len = min(seq, args.sample_len) if args.sample_len > 0 else seq
    row = Row(impl=impl, attn=attn, shape=args.shape, seq=seq, sample_len=sample_len, microbatches=args.microbatches,
              precision=precision)
    cfg = hf_config(args.shape, sample_len)
    rl_cfg = rl_config(sample_len)
    te = impl == "te"
    optim = OptimConfig(lr=1e-6, max_tokens_per_microbatch=seq, use_distributed_optimizer=True)
    model = TrainModel(cfg, optim, dtype="bf16" if cuda else "fp32",
                       impl="transformer_engine" if te else "local", total_steps=1, seed=0,
                       model_options=model_options(args.recompute, precision, parse_options(args.model_option)))
    if cuda:
        sync()
        row.static_mem_gib = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    batch = make_batch(cfg, seq, sample_len, args.microbatches, seed=0)
    rl.set_masks(batch, rl_cfg)
    batch.old_logprobs = torch.zeros_like(batch.response_mask)
    dp_group = ps.get_data_parallel_group()
    rows = list(range(len(batch)))

    def logprob_pass():
        batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)

    def train_step():
        counts = rl.global_counts(batch, rows, dp_group, batch.loss_mask)
        metrics = model.train_step(batch, rl.actor_loss_fn(rl_cfg, counts, 1.0))
        if not math.isfinite(metrics.get("actor/pg_loss", math.nan)):
            raise FloatingPointError(f"non-finite actor loss: {metrics}")

    n_micro = len(model.microbatches(batch))
    if n_micro != args.microbatches:
        raise RuntimeError(f"expected {args.microbatches} micro-batches, TrainModel packed {n_micro}")
    tp = ps.get_tensor_model_parallel_world_size()
    lengths = batch.lengths
    tokens = sum(lengths)
    row.logprob_s = timed(logprob_pass, args.warmup, args.steps)
    row.step_s = timed(train_step, args.warmup, args.steps)
    row.tokens_per_s = tokens / row.step_s / tp
    row.logprob_tokens_per_s = tokens / row.logprob_s / tp
    flops, fwd_flops = step_flops(cfg, lengths, True), step_flops(cfg, lengths, False)
    row.tflops = flops / row.step_s / tp / 1e12
    if peak:
        row.mfu = flops / row.step_s / tp / peak
        row.logprob_mfu = fwd_flops / row.logprob_s / tp / peak
    if cuda:
        row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    if args.profile:
        profile_step(train_step, args.profile)
    del model
    return row


def profile_step(train_step, top: int) -> None:
    """One more train step under torch.profiler: the `top` kernels by device time (CPU: by CPU
    time) and the step's device-busy share, so a low MFU says where the time went."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        train_step()
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events if e.device_type.name == "CUDA") if torch.cuda.is_available() else 0.0
    print(f"profile: step wall {wall * 1e3:.1f} ms under the profiler, device busy {busy / 1e3:.1f} ms "
          f"({busy / 1e6 / wall:.0%})", flush=True)
    print(events.table(sort_by=key, row_limit=top, max_name_column_width=70), flush=True)


def free() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def te_usable() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA"
    try:
        import importlib

        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001
        return False, f"Transformer Engine not importable ({type(err).__name__})"
    return True, ""


def report(rows: list[Row], header: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        na = lambda x, fmt: "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)
        table = Table(title=header)
        for col in ("impl", "attn", "prec", "seq", "sample", "status", "step s", "tok/s/GPU", "TFLOP/s", "MFU",
                    "logprob tok/s", "logprob MFU", "peak GiB", "static GiB"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(r.impl, r.attn, r.precision, str(r.seq), str(r.sample_len), r.status, na(r.step_s, ".3f"),
                          na(r.tokens_per_s, ",.0f"), na(r.tflops, ".1f"), na(r.mfu, ".1%"),
                          na(r.logprob_tokens_per_s, ",.0f"), na(r.logprob_mfu, ".1%"),
                          na(r.peak_mem_gib, ".1f"), na(r.static_mem_gib, ".1f"))
        Console(width=160).print(table)
    except ImportError:
        print(header)
    for r in rows:
        print(r.line(), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--seq", default="4096,16384", help="tokens per micro-batch, comma-separated")
    p.add_argument("--sample-len", type=int, default=2048,
                   help="tokens per sequence (prompt + response); 0 = one sequence per micro-batch")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--impl", default="local,te", help="layer specs: local, te (TE is skipped where absent)")
    p.add_argument("--attn", default="auto", help="local attention kernels, comma-separated: auto (varlen on CUDA "
                   "in bf16), varlen, sdpa, blockwise (megarl.models.attention_kernels)")
    p.add_argument("--profile", type=int, default=0, help="profile one more train step, print the top N kernels")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (world = tp * dp)")
    p.add_argument("--recompute", choices=["selective", "full"], default=None,
                   help="activation recomputation (megatron recompute_granularity)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's peak TFLOP/s")
    p.add_argument("--fp8", default="none", help="precisions of the TE rows, comma-separated: none (bf16) or FP8 "
                   "recipes (delayed, tensorwise, blockwise, mxfp8)")
    p.add_argument("--model-option", action="append", help="TransformerConfig override KEY=VALUE (repeatable)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|TE) .*")
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from megarl.models.attention_kernels import KERNELS
    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    seqs = [int(s) for s in args.seq.split(",") if s.strip()]
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    attns = [s.strip() for s in args.attn.split(",") if s.strip()]
    bad = sorted(set(impls) - {"local", "te"}) + sorted(set(attns) - set(KERNELS))
    if bad:
        raise SystemExit(f"bench_train: unknown --impl / --attn {bad} (choose from local, te / {', '.join(KERNELS)})")
    init_distributed(ParallelSizes(tp=args.tp), seed=0)
    rank = dist.get_rank()
    peak, peak_desc = peak_flops(args.peak_tflops)
    cfg = hf_config(args.shape, max(seqs))
    te_ok, te_why = te_usable()
    rows: list[Row] = []
    failed = False
    precisions = ["bf16" if x.strip() in ("none", "bf16") else x.strip() for x in args.fp8.split(",") if x.strip()]
    for impl, attn, precision, seq in configurations(impls, attns, precisions, seqs):
        sample_len = min(seq, args.sample_len) if args.sample_len > 0 else seq
        blank = lambda status: Row(impl, attn, args.shape, seq, sample_len, args.microbatches, status=status,  # noqa: E731
                                   precision=precision)
        if impl == "te" and not te_ok:
            rows.append(blank(f"skipped: {te_why}"))
            continue
        try:
            rows.append(bench_one(args, impl, attn, seq, peak, precision))
        except torch.cuda.OutOfMemoryError:
            rows.append(blank("OOM"))
        except Exception as err:  # noqa: BLE001 - reported, the next configuration runs
            failed = True
            if rank == 0:
                traceback.print_exc(file=sys.stderr)
            rows.append(blank(f"error: {type(err).__name__}: {err}"))
        if rank == 0:
            print(f"bench_train row: {rows[-1].line()}", flush=True)
        free()
    n_params = matmul_params(cfg)
    size = f"{n_params / 1e9:.3f} B" if n_params >= 1e9 else f"{n_params / 1e6:.2f} M"
    header = (f"bench_train: {args.shape} ({size} matmul params), "
              f"world {dist.get_world_size()} (tp {args.tp}), {'bf16' if torch.cuda.is_available() else 'fp32 cpu'}, "
              f"peak {peak_desc} (FP8 rows: the same FLOPs against it), recompute {args.recompute or 'none'}")
    if rank == 0:
        report(rows, header)
        if args.json:
            Path(args.json).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2))
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
