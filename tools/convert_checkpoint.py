"""Convert between HF safetensors checkpoints and megatron-core torch_dist checkpoints.

    convert_checkpoint.py hf-to-megatron --hf HF_DIR --out CKPT_DIR --tp 2 --pp 1 [--dtype auto]
    convert_checkpoint.py megatron-to-hf --ckpt CKPT_DIR --out HF_DIR [--tp 1 --pp 1] [--max-shard-gb 5]
    convert_checkpoint.py verify --hf HF_DIR --tp 2 --pp 2 [--tol 1e-4]

Run it plainly (it starts tp*pp ranks itself with torchrun when tp*pp > 1) or under torchrun
with a world size that is a multiple of tp*pp. hf-to-megatron reads on every rank only that
rank's slices of the safetensors files; megatron-to-hf streams full HF tensors in buckets to
rank 0, which writes safetensors shards (+ index), config.json and tokenizer files. verify runs
one random batch through HF transformers and the Megatron model (fp32) and prints
`max_abs_logit_diff=<float>` as its last line; it exits 1 when the difference exceeds --tol.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXIT_ERROR, EXIT_MISMATCH = 2, 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    for s in (a, b, c):
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
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

    from megarl.weights.hf_reader import CheckpointError

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
    from megarl.weights.hf_reader import HFCheckpoint
    from megarl.weights.load_hf import check_checkpoint

    if args.cmd in ("hf-to-megatron", "verify"):
        spec = arch_spec(_load_hf_config(args.hf))
        check_checkpoint(HFCheckpoint(args.hf), spec)
    else:
        read_checkpoint_meta(args.ckpt)
        arch_spec(load_checkpoint_hf_config(args.ckpt))


def hf_to_megatron(args, rank: int) -> int:
    from megarl.models import build_model
    from megarl.weights import load_hf_weights, save_megatron_checkpoint

    cfg = _load_hf_config(args.hf)
    model = build_model(cfg, dtype=_model_dtype(args, cfg), impl=args.impl)
    load_hf_weights(model, args.hf)
    save_megatron_checkpoint(model, args.out, cfg, hf_source_dir=args.hf)
    if rank == 0:
        print(f"saved torch_dist checkpoint (tp={args.tp}, pp={args.pp}) to {args.out}")
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


def verify(args, rank: int) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megarl.models import build_model, megatron_forward_logits
    from megarl.weights import load_hf_weights

    cfg = _load_hf_config(args.hf)
    dtype = _model_dtype(args, cfg)
    model = build_model(cfg, dtype=dtype, impl=args.impl)
    load_hf_weights(model, args.hf)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    logits = megatron_forward_logits(model, ids.to(next(model[0].parameters()).device))
    diff = torch.zeros(1, device=logits.device)
    if rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype).eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        diff[0] = (logits.cpu() - ref).abs().max()
    if dist.get_world_size() > 1:
        dist.broadcast(diff, src=0)  # every rank exits with the same status
    if rank == 0:
        print(f"max_abs_logit_diff={diff.item():.6e}", flush=True)
    return EXIT_MISMATCH if diff.item() > args.tol else 0


def run_rank(args) -> int:
    import torch.distributed as dist

    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(tp=args.tp, pp=args.pp), seed=args.seed if args.cmd == "verify" else 0)
    rank = dist.get_rank()
    try:
        fn = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "verify": verify}[args.cmd]
        return fn(args, rank)
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_torchrun(nproc: int, argv: list[str], script: str | Path = __file__) -> int:
    """Runs `script argv` on nproc local ranks with torchrun; returns its exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script), *argv]
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from megarl.models.families import UnsupportedModelError
    from megarl.weights.hf_reader import CheckpointError

    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        if not under_torchrun:
            preflight(args)
            if args.tp * args.pp > 1:
                return launch_torchrun(args.tp * args.pp, argv)
        return run_rank(args)
    except (CheckpointError, UnsupportedModelError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
