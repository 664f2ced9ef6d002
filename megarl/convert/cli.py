"""`megarl convert` (= `python -m tools.convert_checkpoint`): HF safetensors <-> megatron-core torch_dist.

    megarl convert hf-to-megatron --hf HF_DIR --out CKPT_DIR --tp 2 --pp 1 [--dtype auto]
    megarl convert megatron-to-hf --ckpt CKPT_DIR --out HF_DIR [--tp 1 --pp 1] [--max-shard-gb 5]
    megarl convert verify --hf HF_DIR --tp 2 --pp 2 --cp 2 [--packed] [--grad] [--tol 1e-4]

Run it plainly (it starts `world_size(args)` ranks itself with torchrun when that is > 1) or
under torchrun with a world size that is a multiple of it. MoE models take --ep N (expert
parallel; --etp expert-TP, default tp): megatron carves the expert-parallel groups out of the
data-parallel ranks, so the world is the smallest multiple of both tp*pp*cp and etp*ep*pp. hf-to-megatron reads on every rank only that
rank's slices of the safetensors files; megatron-to-hf streams full HF tensors in buckets to
rank 0, which writes safetensors shards (+ index), config.json and tokenizer files. verify runs
one random batch (packed THD like the trainer; --packed: variable lengths) through HF
transformers and the Megatron model (fp32) at tp x pp x cp and prints `max_abs_logit_diff=<float>`;
with --grad also `max_rel_grad_diff=<float>` (max over parameters of |g_megatron - g_hf| / |g_hf|
for the summed log-likelihood, through the trainer's TrainModel path) as its last line. It exits 1
when a difference exceeds --tol. For vision-language models (qwen2_5_vl, qwen3_vl; qwen3_vl_moe, also
with --ep; qwen3_5, qwen3_5_moe) verify feeds random images with the random text
(megarl.convert.verify_vlm); --grad then compares the gradients of the text batch (images: logits only). qwen3_vl_moe's fused expert tensors are read in either on-disk layout and written in
the released one (megarl.weights.expert_layout).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megarl.parallel.launch import run_module

EXIT_ERROR, EXIT_MISMATCH = 2, 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> torch_dist checkpoint")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("megatron-to-hf", help="torch_dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--max-shard-gb", type=float, default=5.0)
    b.add_argument("--bucket-mb", type=float, default=256.0)
    c = sub.add_parser("verify", help="compare HF and Megatron logits on a random batch")
    c.add_argument("--hf", required=True)
    c.add_argument("--tol", type=float, default=1e-4)
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq", type=int, default=16)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--cp", type=int, default=1, help="context-parallel size (world = tp*pp*cp)")
    c.add_argument("--packed", action="store_true", help="variable-length sequences, packed (THD)")
    c.add_argument("--grad", action="store_true",
                   help="also compare gradients of the summed log-likelihood: prints max_rel_grad_diff last")
    for s in (a, b, c):
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
        s.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
        s.add_argument("--dtype", default="auto" if s is not c else "float32",
                       help="float32 | bfloat16 | float16 | auto (config.json's torch_dtype)")
        s.add_argument("--impl", default="local", choices=["local", "te", "transformer_engine"])
    return p.parse_args(argv)


def _model_dtype(args, hf_config):
    from megarl.models.builder import parse_dtype

    if args.dtype != "auto":
        return parse_dtype(args.dtype)
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return parse_dtype(str(dt).removeprefix("torch.") if dt is not None else None)


def _load_hf_config(hf_dir: str):
    from transformers import AutoConfig

    from megarl.models.deepseek import register_kimi_config
    from megarl.weights.hf_reader import CheckpointError

    register_kimi_config()  # Kimi-K2's model_type "kimi_k2" reads as DeepSeek-V3
    if not (Path(hf_dir) / "config.json").exists():
        raise CheckpointError(f"{Path(hf_dir) / 'config.json'} not found")
    try:
        return AutoConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{Path(hf_dir) / 'config.json'}: {e}") from e


def preflight(args) -> None:
    """Checks that need no ranks (config family, checkpoint names/shapes/headers), so a bad
    input fails once, with one message, before torchrun starts."""
    from megarl.models.families import arch_spec
    from megarl.weights.dist_ckpt import load_checkpoint_hf_config, read_checkpoint_meta
    from megarl.weights.load_hf import check_checkpoint, open_checkpoint

    if args.cmd in ("hf-to-megatron", "verify"):
        spec = arch_spec(_load_hf_config(args.hf))
        check_checkpoint(open_checkpoint(args.hf), spec)
    else:
        read_checkpoint_meta(args.ckpt)
        spec = arch_spec(load_checkpoint_hf_config(args.ckpt))
    if args.ep > 1 and (not spec.num_experts or spec.num_experts % args.ep):
        raise ValueError(f"--ep {args.ep} must divide the number of experts ({spec.num_experts} in "
                         f"{spec.model_type!r})")


def hf_to_megatron(args, rank: int) -> int:
    from megarl.models import build_model
    from megarl.weights import load_hf_weights, save_megatron_checkpoint

    cfg = _load_hf_config(args.hf)
    model = build_model(cfg, dtype=_model_dtype(args, cfg), impl=args.impl)
    load_hf_weights(model, args.hf)
    save_megatron_checkpoint(model, args.out, cfg, hf_source_dir=args.hf)
    if rank == 0:
        print(f"saved torch_dist checkpoint (tp={args.tp}, pp={args.pp}, ep={args.ep}) to {args.out}")
    return 0


def megatron_to_hf(args, rank: int) -> int:
    from megarl.models import build_model
    from megarl.weights import (
        consume, load_checkpoint_hf_config, load_megatron_checkpoint, read_checkpoint_meta,
        save_hf_checkpoint, stream_hf_weights)
    from megarl.weights.dist_ckpt import padded_vocab_for

    meta = read_checkpoint_meta(args.ckpt)
    cfg = load_checkpoint_hf_config(args.ckpt)
    model = build_model(cfg, dtype=_model_dtype(args, cfg), impl=args.impl,
                        padded_vocab=padded_vocab_for(meta, args.tp))
    load_megatron_checkpoint(model, args.ckpt)
    stream = stream_hf_weights(model, cfg, bucket_bytes=int(args.bucket_mb * 2**20), receive=rank == 0)
    if rank == 0:
        files = save_hf_checkpoint(stream, args.out, cfg, hf_source_dir=Path(args.ckpt) / "hf",
                                   max_shard_bytes=int(args.max_shard_gb * 2**30))
        print(f"wrote {len(files)} safetensors file(s) + config/tokenizer to {args.out}")
    else:
        consume(stream)
    return 0


def verify_batch(args, vocab: int) -> list:
    """The random batch: `--batch` sequences of `--seq` tokens, or with --packed of random lengths
    in [1, --seq] (mostly not multiples of 2*CP)."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    lengths = (torch.randint(1, args.seq + 1, (args.batch,), generator=gen).tolist() if args.packed
               else [args.seq] * args.batch)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def hf_reference(args, seqs, dtype, grad: bool, vision: bool = False):
    """HF logits of every sequence (run one at a time) and, with grad, the gradients of the summed
    log-likelihood sum_i sum_t log p(x_{i,t+1} | x_{i,<=t}) by HF parameter name (vision: the
    image-text-to-text model, whose names are the checkpoint's, on text alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from megarl.weights.hf_reader import HFCheckpoint

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    hf = auto.from_pretrained(args.hf, dtype=dtype).eval()
    logits = []
    with torch.set_grad_enabled(grad):
        total = 0.0
        for s in seqs:
            out = hf(s[None]).logits[0].float()
            logits.append(out.detach())
            total = total + torch.log_softmax(out[:-1], -1).gather(-1, s[1:, None]).sum()
        if not grad:
            return logits, {}
        total.backward()
    grads = {n: p.grad.float() for n, p in hf.named_parameters() if p.grad is not None}
    return logits, per_expert_grads(grads, on_disk=set(HFCheckpoint(args.hf).names()))


def per_expert_grads(grads: dict, on_disk: set[str]) -> dict:
    """HF gradients under the checkpoint's names: transformers 5 holds each MoE layer's experts as
    two fused parameters (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F])
    that the checkpoint stores per expert (`mlp.experts.{e}.gate_proj.weight`, ...); those are
    split. Fused names the checkpoint itself uses (Qwen3-VL-MoE) stay as they are."""
    out = {}
    for name, g in grads.items():
        base, _, kind = name.rpartition(".")
        if name in on_disk or not base.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            out[name] = g
            continue
        for e in range(g.shape[0]):
            if kind == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = g[e]
            else:
                gate, up = g[e].chunk(2)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
    return out


def megatron_grads(args, cfg, dtype, seqs):
    """Gradients of the same summed log-likelihood through the trainer's own path (TrainModel,
    packed micro-batch, CP chunks, 1F1B under PP, gradients reduced by megatron's DDP), streamed
    out as full HF-named tensors on rank 0 ({} elsewhere)."""
    import torch
    from megatron.core import parallel_state as ps

    from megarl.config.schema import OptimConfig
    from megarl.trainer.batch import StepBatch, Trajectory
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import load_hf_weights, stream_hf_weights

    from megarl.models.families import arch_spec

    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    optim = OptimConfig(lr=0.0, max_tokens_per_microbatch=10**9, use_distributed_optimizer=False)
    # megatron trains an MoE layer at TP > 1 only with sequence parallelism
    sp = bool(arch_spec(cfg).num_experts) and args.tp > 1
    model = TrainModel(cfg, optim, dtype=name, impl=args.impl, model_options={"sequence_parallel": sp})
    load_hf_weights(model.chunks, args.hf)
    trajs = [Trajectory(uid=str(i), prompt_ids=s[:1].tolist(), response_ids=s[1:].tolist(),
                        rollout_logprobs=[], finish_reason="stop") for i, s in enumerate(seqs)]
    batch = StepBatch.from_trajectories(trajs)
    for c in model.chunks:
        c.zero_grad_buffer()
    model.run(model.microbatches(batch), lambda mb, logits: (mb.log_probs(logits).sum(), {}), forward_only=False)
    # every data-parallel rank runs the whole batch and megatron sums the gradients over DP (an
    # expert's over the EP ranks' tokens and expert-DP): DP copies of every gradient
    dp = ps.get_data_parallel_world_size()
    with torch.no_grad():
        for c in model.chunks:
            for p in c.parameters():
                p.copy_((p.main_grad / dp).to(p.dtype))  # the weight stream maps grads like weights
    stream = stream_hf_weights(model.modules, cfg, receive=True)
    grads = {n: t.float().cpu().clone() for bucket in stream for n, t in bucket}
    return grads


def verify(args, rank: int) -> int:
    import torch
    import torch.distributed as dist

    from megarl.models import build_model
    from megarl.models.forward import packed_forward
    from megarl.parallel.distributed import device
    from megarl.weights import load_hf_weights

    cfg = _load_hf_config(args.hf)
    dtype = _model_dtype(args, cfg)
    from megarl.models.families import arch_spec

    spec = arch_spec(cfg)
    stats = torch.zeros(2, device=device())  # max |logit diff|, max relative grad diff
    if spec.vision is not None:  # random images + text (megarl.convert.verify_vlm); gradients on text
        from megarl.convert.verify_vlm import verify_vlm

        rc = verify_vlm(args, cfg, dtype, rank)
        if not args.grad:
            return rc
        stats[0] = float(args.tol) + 1.0 if rc else 0.0
        seqs = verify_batch(args, spec.vocab_size)
        ref_grads = hf_reference(args, seqs, dtype, True, vision=True)[1] if rank == 0 else {}
    else:
        seqs = verify_batch(args, cfg.vocab_size)
        model = build_model(cfg, dtype=dtype, impl=args.impl)
        load_hf_weights(model, args.hf)
        for c in model:
            c.eval()
        with torch.no_grad():
            outs = packed_forward(model, seqs)
        ref_logits, ref_grads = hf_reference(args, seqs, dtype, args.grad) if rank == 0 else ([], {})
        logits = _to_rank0([o.cpu() for o in outs] if outs is not None else None)
        if rank == 0:
            stats[0] = max(float((m - r).abs().max()) for m, r in zip(logits, ref_logits))
        del model
    if args.grad:
        grads = megatron_grads(args, cfg, dtype, seqs)
        if rank == 0:
            missing = sorted(set(ref_grads) - set(grads))
            if missing:
                raise ValueError(f"verify --grad: no Megatron gradient for {missing[:5]}")
            stats[1] = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items())
    if dist.get_world_size() > 1:
        dist.broadcast(stats, src=0)  # every rank exits with the same status
    if rank == 0:
        if spec.vision is None:  # verify_vlm printed its own
            print(f"max_abs_logit_diff={stats[0].item():.6e}", flush=True)
        if args.grad:
            print(f"max_rel_grad_diff={stats[1].item():.6e}", flush=True)
    return EXIT_MISMATCH if float(stats.max()) > args.tol else 0


def _to_rank0(local: list | None) -> list:
    """The last pipeline stage's outputs, on rank 0 (object collective: verify batches are small)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next(g for g in gathered if g is not None)


def run_rank(args) -> int:
    import torch.distributed as dist

    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(tp=args.tp, pp=args.pp, cp=getattr(args, "cp", 1), ep=args.ep, etp=args.etp),
                     seed=args.seed if args.cmd == "verify" else 0)
    rank = dist.get_rank()
    try:
        fn = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "verify": verify}[args.cmd]
        return fn(args, rank)
    finally:
        destroy_distributed()


def world_size(args) -> int:
    """Smallest world megatron accepts: a multiple of tp*pp*cp and of etp*ep*pp."""
    import math

    dense = args.tp * args.pp * getattr(args, "cp", 1)
    return math.lcm(dense, (args.etp or args.tp) * args.ep * args.pp)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from megarl.models.families import UnsupportedModelError
    from megarl.weights.hf_reader import CheckpointError

    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        if not under_torchrun:
            preflight(args)
            world = world_size(args)
            if world > 1:
                return run_module(world, "megarl.convert.cli", argv)
        return run_rank(args)
    except (CheckpointError, UnsupportedModelError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
