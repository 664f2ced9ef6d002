"""Worker (4 gloo ranks): DeepSeek-V3 (multi-latent attention) and GLM-4.5 HF <-> Megatron, one launch.

Tiny random models with odd shapes (`tiny_config`): deepseek_v3 with q_lora_rank, YaRN and 4
expert groups; deepseek_v3 without q_lora_rank (plain RoPE, two shared experts); glm4_moe with
GQA, head_dim 24, partial RoPE, q/k/v biases, q/k norms and 2 groups. All: rope dims != nope
dims, first layer dense, a shared expert, a non-zero selection bias.

Sections (rank 0 writes the JSON):
- verify[family][layout]: `megarl convert verify --packed --grad` (megarl.convert.cli.verify, run
  in this process at each layout): max |logit diff| and max relative gradient difference;
- roundtrip[family][layout]: HF -> Megatron -> stream -> HF, torch.equal on every rank;
- routing[family]: the first MoE layer's experts, megatron's vs HF's, and how many tokens the
  selection bias moves (HF with the bias zeroed);
- ckpt: torch_dist saved at EP2, loaded at EP1 (logits, bit-exact stream, bias included);
- mtp: a checkpoint with a multi-token-prediction layer loads (skipped, said so);
- fp8: a block-FP8 checkpoint (DeepSeek's released format) imported at TP2 x EP2 gives the
  dequantized weights;
- bf16_stream: the bias stays float32 in a bf16 stream;
- engine[family] (TP2 x EP2): perturbed actor weights (and biases) streamed into the builtin
  engine; its sampling log-probs vs the actor's recomputed ones; its logits vs HF's.
"""

import argparse
import contextlib
import io
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

from megarl.models import build_model, megatron_forward_logits
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights import load_megatron_checkpoint, save_hf_checkpoint, save_megatron_checkpoint, stream_hf_weights
from tests.distributed.harness import finish, from_rank0, on_rank0, parse_args
from tests.distributed.scripts_models_common import (
    hf_logits, loaded, max_abs, max_logprob_diff, perturb, roundtrip, save_random, tee)
from tests.distributed.scripts_weight_stream import PROMPTS, actor_logprobs

# (tp, pp, ep): the reference, TP2, EP2, PP2, TP2 x EP2
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2)]
FAMILIES = ("deepseek_v3", "deepseek_v3_noq", "glm4_moe")
NOQ_VERIFY = [(1, 1, 1), (2, 1, 2)]  # the variant without q_lora_rank: verify at these layouts only (CI time)
SEQ, BATCH = 12, 2
MOE = dict(vocab_size=151, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
           n_routed_experts=8, first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6,
           tie_word_embeddings=False, norm_topk_prob=True)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
           v_head_dim=20)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_config(family: str):
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**MOE, **MLA, q_lora_rank=40, num_experts_per_tok=4, n_group=4,
                                             topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                             rope_scaling=YARN)
    if family == "deepseek_v3_noq":
        return transformers.DeepseekV3Config(**MOE, **MLA, q_lora_rank=None, num_experts_per_tok=2, n_group=1,
                                             topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(**MOE, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                          num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                          routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True,
                                          partial_rotary_factor=0.5)
    raise ValueError(family)


@torch.no_grad()
def make_tiny(family: str, path, seed: int = 0) -> Path:
    """Random weights with teeth (`save_random`) and a selection bias N(0, 0.3) per MoE layer."""
    cfg = tiny_config(family)
    model = save_random(lambda: transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), path, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    return Path(path)


def verify_here(hf_dir: Path, tp: int, pp: int, ep: int) -> dict:
    """`megarl convert verify --packed --grad` at this layout, in this process (the launch's world)."""
    from megarl.convert import cli

    args = argparse.Namespace(cmd="verify", hf=str(hf_dir), tol=1e-4, batch=3, seq=SEQ, seed=0, cp=1, packed=True,
                              grad=True, tp=tp, pp=pp, ep=ep, etp=None, dtype="float32", impl="local")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.verify(args, dist.get_rank())
    values = dict(line.split("=") for line in out.getvalue().split() if "=" in line)
    return {"rc": rc, **{k: float(v) for k, v in values.items()}}


def moe_layer_topk(model_chunks, ids) -> torch.Tensor:
    """Experts megatron's first MoE layer (layer 1) picks per token [b*s, k] (sorted)."""
    from megarl.models.routing import moe_routers

    router = dict(moe_routers(model_chunks[0]))[1]
    seen = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    megatron_forward_logits(model_chunks, ids)
    handle.remove()
    return seen[0].nonzero()[:, 1].view(seen[0].shape[0], -1).sort(dim=1).values.cpu()


@torch.no_grad()
def hf_moe_layer_topk(path, ids, zero_bias: bool = False) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gate = model.model.layers[1].mlp.gate
    if zero_bias:
        gate.e_score_correction_bias.zero_()
    seen = []
    gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    model(ids)
    return seen[0].sort(dim=1).values


def with_mtp_layer(src: Path, dst: Path, cfg) -> None:
    """A copy of src with DeepSeek's multi-token-prediction tensors (layer num_hidden_layers) added."""
    tensors = load_file(src / "model.safetensors")
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    extra = {f"model.layers.{n}.{k}": v for k, v in {
        "enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "eh_proj.weight": torch.zeros(h, 2 * h),
        "shared_head.norm.weight": torch.ones(h), "shared_head.head.weight": torch.zeros(cfg.vocab_size, h)}.items()}
    extra.update({k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in tensors.items()
                  if k.startswith(f"model.layers.{n - 1}.")})
    dst.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    cfg.save_pretrained(dst)


def mtp_case(work: Path, ids, ref) -> dict:
    cfg = tiny_config("deepseek_v3")
    on_rank0(with_mtp_layer, work / "deepseek_v3", work / "deepseek_v3_mtp", cfg)
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logging.getLogger("megarl.weights.load_hf").addHandler(handler)
    model = loaded(cfg, work / "deepseek_v3_mtp")
    logging.getLogger("megarl.weights.load_hf").removeHandler(handler)
    added = [k for k in load_file(work / "deepseek_v3_mtp" / "model.safetensors")
             if k.startswith(f"model.layers.{cfg.num_hidden_layers}.")]
    return {"vs_hf": max_abs(megatron_forward_logits(model, ids), ref), "log": logs.getvalue(),
            "mtp_layers": cfg.num_nextn_predict_layers, "added": len(added)}


FP8_BLOCK = (8, 8)  # small blocks: the tiny tensors get several, partial at the edges


def with_fp8_weights(src: Path, dst: Path, cfg) -> None:
    """src with every 2-D linear weight of the decoder layers stored block-FP8 (DeepSeek's format)."""
    from megarl.weights.fp8_blocks import quantize

    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and ".layers." in name and "mlp.gate.weight" not in name:
            out[name], out[name + "_scale_inv"] = quantize(t, FP8_BLOCK)
        else:
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}
    cfg.save_pretrained(dst)


def fp8_case(work: Path) -> dict:
    """The block-FP8 checkpoint imported at this layout: every streamed tensor equals the dequantized
    stored one (megarl.weights.fp8_blocks: slices read per TP rank, scales per block)."""
    from megarl.weights.fp8_blocks import dequantize

    cfg = tiny_config("deepseek_v3")
    on_rank0(with_fp8_weights, work / "deepseek_v3", work / "deepseek_v3_fp8", cfg)
    stored = load_file(work / "deepseek_v3_fp8" / "model.safetensors")
    expected = {n: dequantize(t, stored[n + "_scale_inv"], FP8_BLOCK) if n + "_scale_inv" in stored else t
                for n, t in stored.items() if not n.endswith("_scale_inv")}
    got = {n: t.cpu() for b in stream_hf_weights(loaded(tiny_config("deepseek_v3"), work / "deepseek_v3_fp8"),
                                                  tiny_config("deepseek_v3")) for n, t in b}
    out = work / f"fp8_export_rank{dist.get_rank()}"  # the export holds plain weights: no FP8 claim
    save_hf_checkpoint([list(got.items())], out, transformers.AutoConfig.from_pretrained(work / "deepseek_v3_fp8"))
    return {"quantized": sum(n.endswith("_scale_inv") for n in stored), "same_names": set(got) == set(expected),
            "exact": all(torch.equal(got[n], expected[n].to(got[n].dtype)) for n in expected),
            "source_claims_fp8": "quantization_config" in json.loads((work / "deepseek_v3_fp8/config.json").read_text()),
            "export_claims_fp8": "quantization_config" in json.loads((out / "config.json").read_text())}


@torch.no_grad()
def perturb_biases(model_chunks) -> None:
    from megarl.models.routing import moe_routers

    for c in model_chunks:
        for layer, router in moe_routers(c):
            g = torch.Generator().manual_seed(50 + layer)
            router.expert_bias.add_(0.3 * torch.randn(router.expert_bias.shape, generator=g).to(router.expert_bias.device))


def stream_to_engine(model, cfg, hf_dir: Path) -> dict:
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.torch_model import KVCache
    from megarl.rollout.types import SamplingParams

    perturb(model[0])
    perturb_biases(model)
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    streamed: dict = {}
    engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=32 << 10), streamed))
    sampled = from_rank0(engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)))
    recomputed = actor_logprobs(model, sampled)
    out_dir = hf_dir.parent / f"streamed_{hf_dir.name}_rank{dist.get_rank()}"
    save_hf_checkpoint([list(streamed.items())], out_dir, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        hf_out = hf(ids).logits[0, -1]
        cache = KVCache.allocate(engine.args, 1, ids.shape[1], torch.float32, torch.device("cpu"))
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()[None, None]
        eng_logits = engine.model(ids, torch.arange(ids.shape[1])[None], cache, 0, mask)[0]
    original = load_file(hf_dir / "model.safetensors")
    bias = [k for k in streamed if k.endswith("e_score_correction_bias")]
    return {"logprob_max_abs_diff": max_logprob_diff(sampled, recomputed),
            "n_sampled_tokens": sum(len(x.response_ids) for x in sampled),
            "engine_vs_hf_logits": max_abs(eng_logits, hf_out),
            "biases_streamed": len(bias), "biases_changed": sum(not torch.equal(streamed[k], original[k]) for k in bias)}


def main():
    a = parse_args()
    work = a.root
    init_distributed(ParallelSizes(), seed=3)
    rank = dist.get_rank()
    on_rank0(lambda: [make_tiny(fam, work / fam, seed=i) for i, fam in enumerate(FAMILIES)])
    ids = torch.randint(0, 151, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    refs = {fam: hf_logits(work / fam, ids) for fam in FAMILIES}
    originals = {fam: load_file(work / fam / "model.safetensors") for fam in FAMILIES}
    res = {"verify": {f: {} for f in FAMILIES}, "roundtrip": {f: {} for f in FAMILIES}, "routing": {}, "engine": {}}
    for tp, pp, ep in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp, ep=ep), seed=3)
        layout = f"tp{tp}_pp{pp}_ep{ep}"
        for fam in FAMILIES:
            cfg = tiny_config(fam)
            if fam != "deepseek_v3_noq" or (tp, pp, ep) in NOQ_VERIFY:
                res["verify"][fam][layout] = verify_here(work / fam, tp, pp, ep)
            model = loaded(cfg, work / fam)
            res["roundtrip"][fam][layout] = roundtrip(model, cfg, originals[fam], 32 << 10)
            if (tp, pp, ep) == (1, 1, 1):
                mine, theirs = moe_layer_topk(model, ids), hf_moe_layer_topk(work / fam, ids)
                unbiased = hf_moe_layer_topk(work / fam, ids, zero_bias=True)
                res["routing"][fam] = {"agree": float((mine == theirs).all(1).float().mean()),
                                       "moved_by_bias": float((unbiased != theirs).any(1).float().mean()),
                                       "experts_used": int(mine.unique().numel())}
                bf16 = {n: t.cpu() for b in stream_hf_weights(model, cfg, dtype=torch.bfloat16) for n, t in b}
                bias = [n for n in bf16 if n.endswith("e_score_correction_bias")]
                res.setdefault("bf16_stream", {})[fam] = {
                    "biases": len(bias), "float32": all(bf16[n].dtype == torch.float32 for n in bias),
                    "exact": all(torch.equal(bf16[n], originals[fam][n]) for n in bias),
                    "weights_bf16": bf16["model.embed_tokens.weight"].dtype == torch.bfloat16}
            if (tp, pp, ep) == (1, 1, 2) and fam == "deepseek_v3":
                save_megatron_checkpoint(model, work / "ckpt", cfg, hf_source_dir=work / fam)
                res["ckpt"] = {"saved_vs_hf": max_abs(megatron_forward_logits(model, ids), refs[fam])}
            if (tp, pp, ep) == (2, 1, 2) and fam != "deepseek_v3_noq":
                res["engine"][fam] = stream_to_engine(model, cfg, work / fam)
            if (tp, pp, ep) == (2, 1, 2) and fam == "deepseek_v3":
                res["fp8"] = fp8_case(work)
    init_distributed(ParallelSizes(), seed=3)  # EP1 (4 data-parallel ranks)
    dist.barrier()
    cfg = tiny_config("deepseek_v3")
    model = build_model(cfg)
    load_megatron_checkpoint(model, work / "ckpt")
    res["ckpt"].update(loaded_vs_hf=max_abs(megatron_forward_logits(model, ids), refs["deepseek_v3"]),
                       roundtrip=roundtrip(model, cfg, originals["deepseek_v3"], 32 << 10))
    res["mtp"] = mtp_case(work, ids, refs["deepseek_v3"])
    res["rank"] = rank
    finish(a.out, res)


if __name__ == "__main__":
    main()
