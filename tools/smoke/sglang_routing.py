"""The routed-experts part of tools/gpu_smoke.py's `sglang` check (MoE models), CPU-testable.

Routing replay (`algorithm.routing_replay`) asks SGLang for the experts every token was routed to
(megarl/rollout/sglang/engine.py). The smoke check starts an engine with that switch on a tiny
random Qwen3-MoE written here, generates, and checks what comes back:

- `check_routed_experts`: each sample's `routed_experts` against the model config: shape
  [prompt + response, num_hidden_layers, num_experts_per_tok], int16, experts in
  [0, num_experts) and distinct within a (token, layer); the last token, which no engine
  forwards, holds 0..k-1.
- `reference_agreement`: the top-k experts of every forwarded token recomputed by HF
  transformers (fp32, CPU, read from its routers); the fraction of (token, layer) pairs whose
  expert sets equal the engine's. Rows in the wrong token or layer order drop it to chance.

    python -m tools.smoke.sglang_routing OUT_DIR    # writes the tiny Qwen3-MoE (HF safetensors)
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.smoke.sglang_routing`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/smoke/
    __import__("tools").run_as_module(__file__)

import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence



# least fraction of (token, layer) pairs whose experts equal HF's fp32 top-k: a bf16 forward of the
# tiny model (HF's own, CPU) agrees on 0.955; rows one token off agree on 0.24, swapped layers on 0
MIN_AGREEMENT = 0.8


def moe_shape(config: Any) -> tuple[int, int, int] | None:
    """(num_hidden_layers, num_experts_per_tok, num_experts) of an MoE HF config (a dict or a
    config object; a vision-language config's text_config is read), None for a dense model."""
    def get(c, key):
        return c.get(key) if isinstance(c, dict) else getattr(c, key, None)

    text = get(config, "text_config") or config
    experts = get(text, "num_experts") or get(text, "num_local_experts") or get(text, "n_routed_experts")
    if not experts:
        return None
    return int(get(text, "num_hidden_layers")), int(get(text, "num_experts_per_tok")), int(experts)


def write_tiny_moe(out: str | Path) -> Path:
    """A tiny random Qwen3-MoE (2 layers, hidden 256, 4 / 2 heads of dim 64, 8 experts top-2, byte
    tokenizer) with weights redrawn at std 0.1 (norms in [0.5, 1.5]): HF's 0.02 would leave the
    router logits nearly tied, and a bf16 engine would then pick other experts than fp32 HF."""
    from megarl.tasks.tiny_model import TinyModelSpec, build_byte_tokenizer, build_tiny_model, save_tiny_model
    from tools.smoke import randomize_

    spec = TinyModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, max_position_embeddings=512,
                         seed=0, family="qwen3_moe", num_experts=8, moe_topk=2, moe_intermediate=128)
    tok = build_byte_tokenizer()
    model = build_tiny_model(tok, spec)
    randomize_(model, seed=1)
    return save_tiny_model(out, spec, model=model, tokenizer=tok)


def tiny_moe_dir(out: str | Path) -> Path:
    """`write_tiny_moe(out)` in a child process (once torch.distributed is up, transformers'
    save_pretrained writes on global rank 0 only, and every rank needs its own copy)."""
    out = Path(out)
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tools.smoke.sglang_routing", str(out)], check=True,
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    return out


def check_routed_experts(samples: Sequence, shape: tuple[int, int, int]) -> int:
    """Raises ValueError unless every sample's routed_experts fits `shape` (moe_shape); returns
    the number of forwarded tokens checked."""
    import torch

    layers, k, experts = shape
    n = 0
    for i, s in enumerate(samples):
        r, total = s.routed_experts, len(s.prompt_ids) + len(s.response_ids)
        if r is None:
            raise ValueError(f"sample {i}: no routed_experts (the engine was not asked for them)")
        if tuple(r.shape) != (total, layers, k) or r.dtype != torch.int16:
            raise ValueError(f"sample {i}: routed_experts {tuple(r.shape)} {r.dtype}, expected ({total} tokens = "
                             f"prompt + response, {layers} layers, top-{k}) int16")
        seen = r[: total - 1].long()
        if seen.numel() and (int(seen.min()) < 0 or int(seen.max()) >= experts):
            raise ValueError(f"sample {i}: experts outside [0, {experts}): {int(seen.min())}..{int(seen.max())}")
        if seen.numel() and bool((seen.sort(-1).values.diff(dim=-1) == 0).any()):
            raise ValueError(f"sample {i}: an expert repeated within one (token, layer)'s top-{k}")
        if not torch.equal(r[-1].long(), torch.arange(k).expand(layers, k)):
            raise ValueError(f"sample {i}: the last (never forwarded) token's row is {r[-1].tolist()}, not 0..{k - 1}")
        n += total - 1
    return n


def reference_agreement(samples: Sequence, model_dir: str | Path) -> float:
    """Fraction of (forwarded token, layer) pairs where HF's top-k expert set (fp32, CPU) equals
    the sample's routed_experts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = [layer.mlp.gate for layer in model.model.layers]
    picked: list[torch.Tensor] = []
    k = model.config.num_experts_per_tok

    def record(module, args, out):  # transformers 5: (logits, scores, top-k indices); 4.x: logits
        picked.append(out[2] if isinstance(out, tuple) else out.float().softmax(-1).topk(k, -1).indices)

    hooks = [m.register_forward_hook(record) for m in routers]
    agree = total = 0
    try:
        with torch.no_grad():
            for s in samples:
                ids = list(s.prompt_ids) + list(s.response_ids)
                picked.clear()
                model(torch.tensor([ids[:-1]]))
                ref = torch.stack([p.reshape(len(ids) - 1, -1) for p in picked], 1)  # [tokens, layers, k]
                mine = s.routed_experts[: len(ids) - 1].long()
                agree += int((ref.sort(-1).values == mine.sort(-1).values).all(-1).sum())
                total += ref.shape[0] * ref.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return agree / max(total, 1)


def verdict(samples: Sequence, shape: tuple[int, int, int], model_dir: str | Path) -> str:
    """check_routed_experts + reference_agreement of an engine's samples; ValueError on a failure."""
    layers, k, experts = shape
    n = check_routed_experts(samples, shape)
    agree = reference_agreement(samples, model_dir)
    detail = (f"routed experts of {len(samples)} samples: [prompt + response, {layers} layers, top-{k}] int16 "
              f"of {experts} experts, {n} forwarded tokens; HF fp32 top-{k} agreement {agree:.3f} "
              f"(min {MIN_AGREEMENT})")
    if agree < MIN_AGREEMENT:
        raise ValueError(detail)
    return detail


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="where to write the tiny Qwen3-MoE (HF safetensors)")
    print(write_tiny_moe(parser.parse_args().out_dir))
