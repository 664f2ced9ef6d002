"""Worker (4 gloo ranks): MoE (qwen3_moe, qwen2_moe) HF <-> Megatron at TP x PP x EP, in one launch.

Sections (rank 0 writes the JSON):
- logits[family][layout]: max |Megatron logits - HF logits| (fp32) and HF logit std;
- roundtrip[family][layout]: HF -> Megatron -> stream -> HF, torch.equal on every rank;
- ckpt[family]: torch_dist saved at EP2, loaded at EP1 (logits, bit-exact stream);
- routing[family]: fraction of tokens whose top-k experts megatron and HF agree on (layer 0);
- engine[family] (TP2 x EP2): perturbed actor weights streamed into the builtin engine on every
  rank; its sampling log-probs vs the actor's recomputed ones, and its layer-0 routing vs HF's.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from megarl.models import build_model, megatron_forward_logits
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights import load_megatron_checkpoint, save_hf_checkpoint, save_megatron_checkpoint, stream_hf_weights
from megarl.weights.dist_ckpt import load_checkpoint_hf_config
from tests.distributed.harness import finish, from_rank0, on_rank0, parse_args
from tests.distributed.scripts_models_common import (
    check_layout, hf_logits, max_abs, max_logprob_diff, perturb, roundtrip, save_random, tee)
from tests.distributed.scripts_weight_stream import PROMPTS, actor_logprobs

# (tp, pp, ep, etp): EP2 alone, TP2 x EP2 (expert-TP 2 and 1), PP2 x EP2
LAYOUTS = [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 2, None), (2, 1, 2, 1), (1, 2, 2, None)]
FAMILIES = ("qwen3_moe", "qwen2_moe")
SEQ, BATCH = 12, 2
# odd vocabulary (TP padding), GQA, 6 experts (not a power of two) top-2
MOE_COMMON = dict(vocab_size=151, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                  num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)


def tiny_moe_config(family: str, **overrides):
    kw = dict(MOE_COMMON, **overrides)
    if family == "qwen3_moe":  # Qwen3-MoE renormalises the top-k probabilities
        return transformers.Qwen3MoeConfig(head_dim=24, norm_topk_prob=True, **kw)
    if family == "qwen2_moe":  # shared expert with its sigmoid gate; no renormalisation
        return transformers.Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False, **kw)
    raise ValueError(family)


def make_tiny_moe(family: str, path, seed: int = 0, **overrides) -> Path:
    cfg = tiny_moe_config(family, **overrides)
    save_random(lambda: transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), path, seed)
    return Path(path)


def layer0_topk(model_chunks, ids) -> torch.Tensor:
    """Experts megatron's layer-0 router picks per token [b*s, k] (sorted), via a forward hook."""
    from megarl.models.builder import unwrap

    router = unwrap(model_chunks[0]).decoder.layers[0].mlp.router
    seen = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    megatron_forward_logits(model_chunks, ids)
    handle.remove()
    routing_map = seen[0]  # [tokens, E] bool, packed token order == row-major [b, s]
    return routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).sort(dim=1).values.cpu()


def hf_layer0_topk(path, ids) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = []
    gate = model.model.layers[0].mlp.gate
    gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    with torch.no_grad():
        model(ids)
    return seen[0].sort(dim=1).values


def stream_to_engine(model, cfg, hf_dir: Path) -> dict:
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.types import SamplingParams

    perturb(model[0])
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    streamed: dict = {}
    engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=32 << 10), streamed))
    # every rank recomputes rank 0's samples
    sampled = from_rank0(engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)))
    recomputed = actor_logprobs(model, sampled)
    # the engine's MoE block against HF's on the streamed weights (layer-0 routing, same ids)
    out_dir = hf_dir.parent / f"streamed_{hf_dir.name}_rank{dist.get_rank()}"
    save_hf_checkpoint([list(streamed.items())], out_dir, cfg)  # HF converts per-expert names on load
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    seen = []
    hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2].sort(1).values))
    engine.model.model.layers[0].mlp.routing_log = log = []
    with torch.no_grad():
        hf_out = hf(ids).logits[0, -1]
        from megarl.rollout.torch_model import KVCache

        cache = KVCache.allocate(engine.args, 1, ids.shape[1], torch.float32, torch.device("cpu"))
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()[None, None]
        eng_logits = engine.model(ids, torch.arange(ids.shape[1])[None], cache, 0, mask)[0]
    engine.model.model.layers[0].mlp.routing_log = None
    return {"logprob_max_abs_diff": max_logprob_diff(sampled, recomputed),
            "n_sampled_tokens": sum(len(x.response_ids) for x in sampled),
            "engine_vs_hf_logits": max_abs(eng_logits, hf_out),
            "routing_equal_hf": bool(torch.equal(log[0], seen[0]))}


def main():
    a = parse_args()
    work = a.root
    init_distributed(ParallelSizes(), seed=3)
    rank = dist.get_rank()
    on_rank0(lambda: [make_tiny_moe(fam, work / fam, seed=i) for i, fam in enumerate(FAMILIES)])
    ids = torch.randint(0, 151, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    refs = {fam: hf_logits(work / fam, ids) for fam in FAMILIES}
    originals = {fam: load_file(work / fam / "model.safetensors") for fam in FAMILIES}
    res = {"logits": {f: {} for f in FAMILIES}, "roundtrip": {f: {} for f in FAMILIES}, "ckpt": {},
           "routing": {}, "engine": {}}
    for tp, pp, ep, etp in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp), seed=3)
        layout = f"tp{tp}_pp{pp}_ep{ep}" + (f"_etp{etp}" if etp else "")
        for fam in FAMILIES:
            cfg = tiny_moe_config(fam)
            model, out, res["logits"][fam][layout], res["roundtrip"][fam][layout] = check_layout(
                cfg, work / fam, lambda m: megatron_forward_logits(m, ids), refs[fam], originals[fam], 32 << 10)
            if (tp, pp, ep) == (1, 1, 1):
                mine, theirs = layer0_topk(model, ids), hf_layer0_topk(work / fam, ids)
                res["routing"][fam] = {"agree": float((mine == theirs).all(1).float().mean()),
                                       "experts_used": int(mine.unique().numel())}
            if (tp, pp, ep, etp) == (1, 1, 2, None):
                save_megatron_checkpoint(model, work / f"ckpt_{fam}", cfg, hf_source_dir=work / fam)
                res["ckpt"][fam] = {"saved_vs_hf": max_abs(out, refs[fam])}
                if rank == 0:
                    torch.save(out, work / f"ckpt_{fam}_logits.pt")
            if (tp, pp, ep, etp) == (2, 1, 2, None):
                res["engine"][fam] = stream_to_engine(model, cfg, work / fam)

    init_distributed(ParallelSizes(), seed=3)  # EP1 (4 data-parallel ranks)
    dist.barrier()
    for fam in FAMILIES:
        ckpt = work / f"ckpt_{fam}"
        cfg = load_checkpoint_hf_config(ckpt)
        model = build_model(cfg)
        load_megatron_checkpoint(model, ckpt)
        out = megatron_forward_logits(model, ids)
        saved = torch.load(work / f"ckpt_{fam}_logits.pt", weights_only=True)
        res["ckpt"][fam].update(loaded_vs_saved=max_abs(out, saved), loaded_vs_hf=max_abs(out, refs[fam]),
                                roundtrip=roundtrip(model, cfg, originals[fam], 32 << 10),
                                saved_ep=json.loads((ckpt / "megarl_model.json").read_text())["saved_ep"])
    finish(a.out, res)


if __name__ == "__main__":
    main()
