"""Worker (4 gloo ranks): Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (hybrid gated delta-net / gated
attention) HF <-> Megatron, one launch.

Tiny random models (`tiny_config`): 4 layers, three gated delta-net layers then one full attention
layer (so PP2's two stages hold different layer kinds), 2 key / 4 value heads of 8 / 12 in the
delta-net, head_dim 16 or 32 with partial RoPE 0.25, MoE of 4 experts top-2 with a gated shared
expert; Qwen3.5 with a 2-block vision tower and interleaved M-RoPE. Weights N(0, 0.1) (`make_tiny`).

Sections (rank 0 writes the JSON):
- verify[family][layout]: `megarl convert verify --packed --grad` (vision models: logits with
  images, gradients on text) at each layout;
- roundtrip[family][layout]: HF -> Megatron -> stream -> HF, torch.equal on every rank;
- layer[family][tp]: each delta-net layer of the Megatron model against HF's `linear_attn` of the
  same layer on HF's own inputs to it (max |diff|), at TP1 and TP2;
- packed[family]: logits of the last sequence of a packed row with the earlier sequences' tokens
  changed (max |diff| against unchanged), at TP2;
- ckpt: torch_dist saved at TP2, loaded at TP1 (logits against HF, bit-exact stream);
- engine[family] (TP2 x EP2): perturbed actor weights streamed into the builtin engine; its sampling
  log-probs against the actor's own (Qwen3.5-MoE: prompts with images).
"""

import argparse
import contextlib
import io
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from megarl.models import build_model
from megarl.models.forward import packed_forward
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights import load_megatron_checkpoint, save_megatron_checkpoint
from tests.distributed.harness import finish, on_rank0, parse_args
from tests.distributed.scripts_models_common import loaded, max_abs, roundtrip

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2)]
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1)]  # qwen3_5 has no experts
SEQ = 14
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
TEXT = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, **GDN)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, in_channels=3)
TOKENS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)  # scripts_qwen3_vl_common's


def tiny_config(family: str):
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=96, head_dim=16)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = dict(TEXT, head_dim=32, rope_parameters=rope)
    if family == "qwen3_5":
        return transformers.Qwen3_5Config(text_config=dict(text, intermediate_size=96), vision_config=VISION, **TOKENS)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeConfig(text_config=dict(text, **MOE), vision_config=VISION, **TOKENS)
    raise ValueError(family)


def hf_class(family: str):
    return transformers.AutoModelForCausalLM if family == "qwen3_next" else transformers.AutoModelForImageTextToText


@torch.no_grad()
def make_tiny(family: str, path: Path, seed: int) -> Path:
    """Random weights N(0, 0.1), the delta-net's convolutions N(0, 1); zero-centred norms N(0, 0.1)
    (scale about 1), the delta-net's gated norm and the vision LayerNorms U(0.5, 1.5); saved by
    transformers."""
    torch.manual_seed(seed)
    model = hf_class(family).from_config(tiny_config(family), dtype=torch.float32)
    for name, p in model.named_parameters():
        plain_norm = name.endswith("linear_attn.norm.weight") or ("visual" in name and "norm" in name)
        if plain_norm:
            p.uniform_(0.5, 1.5)
        elif name.endswith("conv1d.weight") and "linear_attn" in name:
            p.normal_(0.0, 1.0)  # keys of a fair size: L2-normalising near-zero keys amplifies rounding
        else:
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def verify_here(hf_dir: Path, tp: int, pp: int, ep: int) -> dict:
    """`megarl convert verify --packed --grad` at this layout, in this process (the launch's world)."""
    from megarl.convert import cli

    args = argparse.Namespace(cmd="verify", hf=str(hf_dir), tol=1e-4, batch=3, seq=SEQ, seed=0, cp=1, packed=True,
                              grad=True, tp=tp, pp=pp, ep=ep, etp=None, dtype="float32", impl="local")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.verify(args, dist.get_rank())
    values = dict(line.split("=") for line in out.getvalue().split() if "=" in line and "max_" in line)
    return {"rc": rc, **{k: float(v) for k, v in values.items()}}


@torch.no_grad()
def delta_net_layers(model, family: str, path: Path, ids: torch.Tensor) -> dict:
    """Each delta-net layer (self_attention of the Megatron layer) on the input HF's linear_attn of
    that layer received: max |output difference| per layer, and the outputs' scale."""
    from megarl.models.attention import thd_params
    from megarl.parallel.distributed import device

    hf = hf_class(family).from_pretrained(path, dtype=torch.float32).eval()
    layers = hf.model.layers if family == "qwen3_next" else hf.model.language_model.layers
    seen = {}
    for i, layer in enumerate(layers):
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.register_forward_hook(
                lambda m, a, k, o, i=i: seen.__setitem__(i, (k["hidden_states"], o)), with_kwargs=True)
    hf(input_ids=ids)
    out = {}
    for i, (x, ref) in seen.items():
        mine, _ = model[0].decoder.layers[i].self_attention(
            x.transpose(0, 1).to(device()), None, packed_seq_params=thd_params([0, x.shape[1]], device=device()))
        out[str(i)] = {"diff": max_abs(mine[:, 0].cpu(), ref[0]), "scale": float(ref.abs().max())}
    return out


@torch.no_grad()
def packed_independence(model, vocab: int) -> dict:
    """The last sequence of a packed row, after earlier sequences whose tokens then change."""
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 70, 13)]
    changed = [torch.randint(0, vocab, (len(s),), generator=gen) for s in seqs[:2]] + [seqs[2]]
    a, b = packed_forward(model, seqs), packed_forward(model, changed)
    if a is None:
        return {}
    return {"last_diff": max_abs(a[2].cpu(), b[2].cpu()), "first_diff": max_abs(a[0].cpu(), b[0].cpu())}


@torch.no_grad()
def stream_to_engine(model, cfg, family: str, hf_dir: Path) -> dict:
    """Perturbed actor weights streamed (TP2 x EP2) into the builtin engine; the engine's sampling
    log-probs against the actor's own of the same tokens (text prompts; for Qwen3.5-MoE prompts with
    one and two images, the actor run with their pixels)."""
    from megarl.models.vision.forward import vlm_forward_logits
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.types import SamplingParams
    from megarl.weights import stream_hf_weights
    from tests.distributed.harness import from_rank0
    from tests.distributed.scripts_models_common import max_logprob_diff, perturb
    from tests.distributed.scripts_qwen3_vl_common import make_prompt
    from tests.distributed.scripts_weight_stream import PROMPTS, actor_logprobs

    perturb(model[0])
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    engine.update_weights(stream_hf_weights(model, cfg, bucket_bytes=32 << 10))
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    if family == "qwen3_next":
        sampled = from_rank0(engine.generate(PROMPTS, sampling))
        return {"logprob_max_abs_diff": max_logprob_diff(sampled, actor_logprobs(model, sampled)),
                "n_tokens": sum(len(x.response_ids) for x in sampled)}
    made = [make_prompt([(20, 37)], seed=1), make_prompt([(48, 40), (9, 9)], seed=2), make_prompt(seed=3)]
    images = [im for _, im in made]
    sampled = from_rank0(engine.generate([p for p, _ in made], sampling, images=images))
    sampled = [s for s in sampled if not set(s.response_ids) & {150, 151}]  # a generated placeholder stays text
    ref = []
    for s in sampled:
        im = images[s.index] or {}
        logits = vlm_forward_logits(model, torch.tensor([s.prompt_ids + s.response_ids]), im.get("pixel_values"),
                                    im.get("image_grid_thw"))[0]
        lp = torch.log_softmax(logits, -1)
        p = len(s.prompt_ids)
        ref.append([float(lp[p - 1 + i, t]) for i, t in enumerate(s.response_ids)])
    return {"logprob_max_abs_diff": max_logprob_diff(sampled, ref), "n_tokens": sum(len(x.response_ids) for x in sampled)}


def main():
    a = parse_args()
    work = a.root
    init_distributed(ParallelSizes(), seed=3)
    on_rank0(lambda: [make_tiny(fam, work / fam, seed=i) for i, fam in enumerate(FAMILIES)])
    ids = torch.randint(0, 150, (1, 24), generator=torch.Generator().manual_seed(0))
    originals = {fam: load_file(work / fam / "model.safetensors") for fam in FAMILIES}
    res = {k: {f: {} for f in FAMILIES} for k in ("verify", "roundtrip", "layer")}
    res["packed"] = {}
    for tp, pp, ep in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp, ep=ep), seed=3)
        layout = f"tp{tp}_pp{pp}_ep{ep}"
        for fam in FAMILIES:
            if fam == "qwen3_5" and ep > 1:
                continue
            cfg = tiny_config(fam)
            res["verify"][fam][layout] = verify_here(work / fam, tp, pp, ep)
            model = loaded(cfg, work / fam)
            for chunk in model:
                chunk.eval()
            res["roundtrip"][fam][layout] = roundtrip(model, cfg, originals[fam], 32 << 10)
            if pp == 1 and ep == 1:
                res["layer"][fam][f"tp{tp}"] = delta_net_layers(model, fam, work / fam, ids)
            if (tp, pp, ep) == (2, 1, 1):
                res["packed"][fam] = packed_independence(model, 150)
            if (tp, pp, ep) == (2, 1, 2) and fam != "qwen3_5":
                res.setdefault("engine", {})[fam] = stream_to_engine(model, cfg, fam, work / fam)
            if (tp, pp, ep) == (2, 1, 1) and fam == "qwen3_next":
                save_megatron_checkpoint(model, work / "ckpt", cfg, hf_source_dir=work / fam)
    init_distributed(ParallelSizes(), seed=3)  # TP1 (4 data-parallel ranks)
    dist.barrier()
    cfg = tiny_config("qwen3_next")
    model = build_model(cfg)
    load_megatron_checkpoint(model, work / "ckpt")
    ref = loaded(cfg, work / "qwen3_next")
    for chunk in (*model, *ref):
        chunk.eval()
    seqs = [ids[0, :17], ids[0, 3:]]
    mine, theirs = packed_forward(model, seqs), packed_forward(ref, seqs)
    res["ckpt"] = {"loaded_vs_hf_import": max(max_abs(x.cpu(), y.cpu()) for x, y in zip(mine, theirs)),
                   "roundtrip": roundtrip(model, cfg, originals["qwen3_next"], 32 << 10)}
    finish(a.out, res)


if __name__ == "__main__":
    main()
