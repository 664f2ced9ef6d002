"""Rollout benchmark: builtin engine vs HF `generate` tokens/s on the same model and prompts.

    .venv/bin/python -m tools.bench.rollout [--device cpu|cuda] [--prompts 32] [--new-tokens 64]

Model: a random Qwen2-architecture model (4 layers, hidden 256, vocab 1000), built from config
and saved to a temp dir. Both sides decode greedily with EOS disabled, so every prompt produces
exactly --new-tokens tokens and both produce the same token count. Prompt lengths vary (8..40).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.rollout`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import tempfile
import time

import torch
from tools._options import add_options


def build_model(device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    return model


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    """Seconds for one left-padded batched `generate` call (greedy, no EOS)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    _sync(device)
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start


def bench_builtin(engine, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    from megarl.rollout import SamplingParams

    _sync(device)
    start = time.perf_counter()
    samples = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new_tokens))
    _sync(device)
    assert all(len(s.response_ids) == new_tokens for s in samples)
    return time.perf_counter() - start


def bench_weight_stream() -> None:
    """Slot for the weight-stream benchmark (GB/s vs raw gloo all_gather), added by the lead."""


def main() -> None:
    from megarl.rollout import BuiltinEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_options(parser, prompts=32, new_tokens=64, repeats=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    model = build_model(args.device, dtype)
    prompts = make_prompts(args.prompts, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir)
        engine = BuiltinEngine.from_pretrained(hf_dir, dtype=dtype, device=args.device)
    engine.eos_token_ids = []

    tokens = args.prompts * args.new_tokens
    bench_builtin(engine, prompts[:2], 4, args.device)  # warm-up
    bench_hf_generate(model, prompts[:2], 4, args.device)
    t_builtin, t_hf = float("inf"), float("inf")
    for _ in range(args.repeats):  # interleaved, best of N: both sides see the same machine load
        t_builtin = min(t_builtin, bench_builtin(engine, prompts, args.new_tokens, args.device))
        t_hf = min(t_hf, bench_hf_generate(model, prompts, args.new_tokens, args.device))
    print(f"device={args.device} dtype={args.dtype} prompts={args.prompts} "
          f"new_tokens={args.new_tokens} threads={torch.get_num_threads()}")
    print(f"builtin engine : {tokens / t_builtin:9.1f} tokens/s ({t_builtin:.3f} s)")
    print(f"HF generate    : {tokens / t_hf:9.1f} tokens/s ({t_hf:.3f} s)")
    print(f"ratio builtin/HF: {t_hf / t_builtin:.2f}x")
    bench_weight_stream()


if __name__ == "__main__":
    main()
