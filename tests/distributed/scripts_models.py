"""Worker (4 gloo ranks): HF <-> Megatron equivalence across TP/PP layouts, in one launch.

Sections (results keyed in the JSON that rank 0 writes):
- logits[family][layout]: max |Megatron logits - HF logits| (fp32);
- roundtrip[family][layout]: HF -> Megatron -> stream -> HF compared with torch.equal on every
  rank (all ranks receive the stream), bucket count;
- ckpt[family]: torch_dist saved at TP=2,PP=1, loaded at TP=1,PP=2: logits diff and exactness;
- loss[family][layout] (PP=1): Megatron's vocab-parallel cross-entropy over the padded vocab
  vs F.cross_entropy of the HF logits (the padded columns must not leak into the softmax);
- critic[layout]: value model (value_head=True) from the qwen2 weights vs HF hidden states @
  score.weight; a critic checkpoint saved at TP=2,PP=1 and loaded at TP=1,PP=2;
- optim: one Adam step at TP=1 and TP=2 on the same global batch; updated HF tensors compared.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from megarl.models import build_model, megatron_forward_logits
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.weights import (
    load_checkpoint_hf_config, load_megatron_checkpoint, read_checkpoint_meta,
    save_megatron_checkpoint)
from megarl.weights.dist_ckpt import padded_vocab_for
from tests.distributed.harness import finish, on_rank0, parse_args
from tests.distributed.scripts_models_common import (
    FAMILIES, check_layout, hf_logits, loaded, logits_vs, make_tiny_hf, max_abs, roundtrip, streamed, tiny_config)

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SEQ, BATCH = 12, 2


def megatron_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [b, s-1] from GPTModel(labels=...) (PP=1 only)."""
    from megarl.models.forward import causal_mask

    s = ids.shape[1] - 1
    ids = ids.to(device())
    pos = torch.arange(s, device=ids.device)[None].expand(ids.shape[0], s)
    with torch.no_grad():
        return model[0](ids[:, :-1], pos, causal_mask(s, ids.device), labels=ids[:, 1:]).cpu()


def critic_check(work: Path, ids: torch.Tensor, layout: str, rank: int) -> dict:
    cfg = tiny_config("qwen2")
    critic = loaded(cfg, work / "qwen2", value_head=True, seed=5)  # lm_head.weight ignored, score.weight absent
    values = megatron_forward_logits(critic, ids)
    tensors = streamed(critic, cfg)
    base = transformers.AutoModel.from_pretrained(work / "qwen2", dtype=torch.float32)
    with torch.no_grad():
        ref = base(ids).last_hidden_state @ tensors["score.weight"].T
    out = {**logits_vs(values, ref), "has_lm_head": "lm_head.weight" in tensors, "n_keys": len(tensors)}
    if layout == "tp2_pp1":
        save_megatron_checkpoint(critic, work / "ckpt_critic", cfg)
        if rank == 0:
            torch.save(values, work / "critic_values.pt")
    if layout == "tp1_pp2":
        dist.barrier()
        fresh = build_model(cfg, value_head=True, seed=99)  # different head init
        load_megatron_checkpoint(fresh, work / "ckpt_critic")
        reloaded = megatron_forward_logits(fresh, ids)
        saved = torch.load(work / "critic_values.pt", weights_only=True) if rank == 0 else reloaded
        out["reloaded_vs_saved"] = max_abs(reloaded, saved)
    return out


def optimizer_step(hf_dir: Path, cfg, batch: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.forward import causal_mask

    chunks = loaded(cfg, hf_dir)
    config = chunks[0].config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    # adam_eps 1e-4: Adam's first step is lr * g / (|g| + eps), which for |g| ~ 1e-8 (the
    # default eps) turns fp32 reduction-order noise in g into O(lr) differences.
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-4, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp])
    local = batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()].to(device())
    mask, pos = causal_mask(SEQ, device()), torch.arange(SEQ, device=device())[None].expand(local.shape[0], SEQ)

    def step(it, model):
        ids = next(it)
        out = model(ids[:, :-1], pos[:, :-1], mask[..., :-1, :-1], labels=ids[:, 1:])
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    ddp.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([local]), model=[ddp],
                                num_microbatches=1, seq_length=SEQ - 1, micro_batch_size=local.shape[0])
    ok, grad_norm, _ = opt.step()
    return {"tensors": streamed([ddp], cfg), "grad_norm": float(grad_norm), "ok": bool(ok)}


def main():
    args = parse_args()
    work = args.root
    init_distributed(ParallelSizes(1, 1), seed=3)
    rank = dist.get_rank()
    on_rank0(lambda: [make_tiny_hf(fam, work / fam, seed=i) for i, fam in enumerate(FAMILIES)])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 130, (BATCH, SEQ), generator=gen)
    refs = {fam: hf_logits(work / fam, ids) for fam in FAMILIES}
    originals = {fam: load_file(work / fam / "model.safetensors") for fam in FAMILIES}
    res = {"logits": {f: {} for f in FAMILIES}, "roundtrip": {f: {} for f in FAMILIES}, "ckpt": {},
           "loss": {f: {} for f in FAMILIES}, "critic": {}}

    for tp, pp in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=3)
        layout = f"tp{tp}_pp{pp}"
        for fam in FAMILIES:
            cfg = tiny_config(fam)
            model, out, res["logits"][fam][layout], res["roundtrip"][fam][layout] = check_layout(
                cfg, work / fam, lambda m: megatron_forward_logits(m, ids), refs[fam], originals[fam], 16 << 10)
            if pp == 1:
                ref_nll = F.cross_entropy(refs[fam][:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                          reduction="none").view(BATCH, SEQ - 1)
                res["loss"][fam][layout] = max_abs(megatron_loss(model, ids), ref_nll)
            if (tp, pp) == (2, 1) and fam in ("qwen2", "llama_tied"):
                save_megatron_checkpoint(model, work / f"ckpt_{fam}", cfg, hf_source_dir=work / fam)
                res["ckpt"][fam] = {"saved_logits_diff": max_abs(out, refs[fam])}
                torch.save(out, work / f"ckpt_{fam}_logits.pt") if rank == 0 else None
        res["critic"][layout] = critic_check(work, ids, layout, rank)

    init_distributed(ParallelSizes(tp=1, pp=2), seed=3)
    for fam in ("qwen2", "llama_tied"):
        ckpt = work / f"ckpt_{fam}"
        cfg = load_checkpoint_hf_config(ckpt)
        meta = read_checkpoint_meta(ckpt)
        model = build_model(cfg, padded_vocab=padded_vocab_for(meta, 1))
        load_megatron_checkpoint(model, ckpt)
        out = megatron_forward_logits(model, ids)
        saved = torch.load(work / f"ckpt_{fam}_logits.pt", weights_only=True) if rank == 0 else out
        res["ckpt"][fam].update(loaded_vs_saved=max_abs(out, saved), loaded_vs_hf=max_abs(out, refs[fam]),
                                roundtrip=roundtrip(model, cfg, originals[fam], 16 << 10), meta=meta)

    batch = torch.randint(0, 150, (4, SEQ), generator=gen)
    cfg = tiny_config("qwen2")
    steps = {}
    for tp in (1, 2):
        init_distributed(ParallelSizes(tp=tp, pp=1), seed=3)
        steps[tp] = optimizer_step(work / "qwen2", cfg, batch)
    a, b, orig = steps[1]["tensors"], steps[2]["tensors"], originals["qwen2"]
    res["optim"] = {
        "keys_equal": set(a) == set(b) == set(orig),
        "max_update_diff": max(max_abs(a[k], b[k]) for k in a),
        "min_update_size": min(max_abs(a[k], orig[k]) for k in a),
        "grad_norms": [steps[1]["grad_norm"], steps[2]["grad_norm"]],
        "ok": [steps[1]["ok"], steps[2]["ok"]],
    }
    finish(args.out, res)


if __name__ == "__main__":
    main()
