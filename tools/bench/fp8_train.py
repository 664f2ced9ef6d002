"""FP8 trains: each FP8 recipe for ~50 optimizer steps on a fixed packed batch stream, against bf16.

    python -m tools.bench.fp8_train --shape 0.5b --steps 50 --recipes bf16,delayed,tensorwise,blockwise,mxfp8
    python -m tools.bench.fp8_train --shape tiny --steps 8 --recipes bf16      # CPU: the loop itself (fp32)

The stream: a fixed sequence of step batches (same seed for every recipe) of packed sequences that
follow a learnable rule, so the loss falls from ~ln(V) within a few dozen steps: each sequence
starts at a random token of the first 1000 and continues x -> (7 x + 13) mod 1000, one token in
ten replaced by a uniformly random one (which keeps the loss away from 0). Every recipe trains
the same randomly initialised model (TE spec, bf16 parameters; `fp8="hybrid"`: E4M3 forward,
E5M2 gradients; `fp8_recipe` as named) with AdamW on the token-mean NLL through
`TrainModel.train_step`; `bf16` is the same without FP8 (on CPU: fp32 and the local spec).

Band: the mean loss of the last 10 steps, L_fp8 against L_bf16, must satisfy
|L_fp8 - L_bf16| <= 0.1 x (L_0 - L_bf16) + 0.02, i.e. FP8 learns what bf16 learns to within a
tenth of what bf16 learned (L_0: the first step's bf16 loss). FP8's per-tensor / per-block scaling
costs a few percent of relative precision per GEMM operand (E4M3 has 3 mantissa bits), which
published FP8 recipes show as loss curves within a fraction of a percent of bf16 over long runs; a
broken scale (a recipe that does not train) misses the band by the whole drop. A recipe the GPU
cannot run (mxfp8 before Blackwell) is reported as refused with megarl's reason (megarl.models.fp8).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

BAND_FRACTION, BAND_SLACK, TAIL = 0.1, 0.02, 10


def rule_sequence(rng: random.Random, length: int, vocab: int) -> list[int]:
    """x -> (7x + 13) mod m (m = min(1000, vocab): a permutation, 7 being prime to m) from a random
    start, one token in ten uniformly random in [0, vocab)."""
    m = min(1000, vocab)
    x = rng.randrange(m)
    out = []
    for _ in range(length):
        out.append(rng.randrange(vocab) if rng.random() < 0.1 else x)
        x = (7 * x + 13) % m
    return out


def stream(vocab: int, steps: int, tokens: int, seq_len: int, seed: int = 0):
    """`steps` step batches of `tokens // seq_len` sequences (prompt: the first token)."""
    from megarl.trainer.batch import StepBatch, Trajectory

    rng = random.Random(seed)
    for _ in range(steps):
        trajs = []
        for i in range(max(1, tokens // seq_len)):
            ids = rule_sequence(rng, seq_len, vocab)
            trajs.append(Trajectory(uid=str(i), prompt_ids=ids[:1], response_ids=ids[1:], rollout_logprobs=[],
                                    finish_reason="stop"))
        yield StepBatch.from_trajectories(trajs)


def in_band(fp8_tail: float, bf16_tail: float, bf16_first: float) -> tuple[bool, float]:
    """(within the module docstring's band, the band's half-width)."""
    width = BAND_FRACTION * max(bf16_first - bf16_tail, 0.0) + BAND_SLACK
    return math.isfinite(fp8_tail) and abs(fp8_tail - bf16_tail) <= width, width


def train(shape: str, recipe: str, steps: int, tokens: int, seq_len: int, lr: float) -> dict:
    import torch

    from megarl.config.schema import OptimConfig
    from megarl.trainer.train_model import TrainModel
    from tools.bench.train import hf_config

    cuda = torch.cuda.is_available()
    if recipe != "bf16" and not cuda:
        return {"recipe": recipe, "status": "skipped: FP8 needs Transformer Engine on a GPU"}
    cfg = hf_config(shape, seq_len)
    options = None if recipe == "bf16" else {"fp8": "hybrid", "fp8_recipe": recipe}
    optim = OptimConfig(lr=lr, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0, max_tokens_per_microbatch=tokens,
                        use_distributed_optimizer=True)
    torch.manual_seed(0)
    try:
        model = TrainModel(cfg, optim, dtype="bf16" if cuda else "fp32", impl="transformer_engine" if cuda else "local",
                           total_steps=steps, seed=0, model_options=options)
    except ValueError as err:  # a recipe this GPU cannot run (megarl.models.fp8)
        return {"recipe": recipe, "status": f"refused: {err}"}
    losses, t0 = [], time.perf_counter()
    for step, batch in enumerate(stream(cfg.vocab_size, steps, tokens, seq_len)):
        n = float(batch.response_mask.sum())

        def nll(mb, output, n=n):
            loss = -(mb.log_probs(output) * mb.data.response_mask).sum() / n
            return loss, {"nll": loss.detach()}

        model.set_lr(step)
        losses.append(model.train_step(batch, nll)["nll"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"recipe": recipe, "status": "ok", "losses": losses, "first": losses[0],
            "tail": sum(losses[-TAIL:]) / len(losses[-TAIL:]), "step_s": seconds / steps}


def judge(rows: list[dict]) -> list[dict]:
    """Each FP8 row against the bf16 row (status FAIL outside the band)."""
    base = next((r for r in rows if r["recipe"] == "bf16" and r["status"] == "ok"), None)
    for r in rows:
        if r["recipe"] == "bf16" or r["status"] != "ok" or base is None:
            continue
        ok, width = in_band(r["tail"], base["tail"], base["first"])
        r["band"] = width
        r["delta"] = r["tail"] - base["tail"]
        if not ok:
            r["status"] = f"FAIL: last-{TAIL} mean loss {r['tail']:.4f} vs bf16 {base['tail']:.4f} (band +-{width:.4f})"
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--recipes", default="bf16,delayed,tensorwise,blockwise,mxfp8")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (one micro-batch)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from megarl.models.fp8 import RECIPES
    from tools.bench.train import SHAPES

    bad = sorted(set(args.recipes.split(",")) - {"bf16", *RECIPES}) + ([args.shape] if args.shape not in SHAPES else [])
    if bad:
        p.error(f"unknown recipes / shape {bad} (recipes bf16, {', '.join(RECIPES)}; shapes {sorted(SHAPES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=0)
    rows = []
    for recipe in [r for r in args.recipes.split(",") if r]:
        try:
            rows.append(train(args.shape, recipe, args.steps, args.tokens, args.seq_len, args.lr))
        except Exception as err:  # noqa: BLE001 - reported; the next recipe runs
            rows.append({"recipe": recipe, "status": f"error: {type(err).__name__}: {str(err)[:300]}"})
        print("fp8_train " + json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    rows = judge(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "steps": args.steps, "rows": rows}, indent=2))
    destroy_distributed()
    return 1 if any(r["status"].startswith(("FAIL", "error")) for r in rows) else 0


def summary(row: dict) -> str:
    """One table cell of a row (tools/bench/gpu_report.py)."""
    if row["status"] != "ok":
        return row["status"]
    text = f"loss {row['first']:.3f} -> {row['tail']:.3f} (last {TAIL}), {row['step_s'] * 1e3:.0f} ms/step"
    if "delta" in row:
        text += f", vs bf16 {row['delta']:+.4f} (band +-{row['band']:.4f})"
    return text


if __name__ == "__main__":
    sys.exit(main())
