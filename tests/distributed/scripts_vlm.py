"""Worker (4 gloo ranks, strict device mode): Qwen2.5-VL HF <-> Megatron across TP/PP layouts.

Models (tests/distributed/scripts_vlm_common.py): a tiny random qwen2_5_vl, untied and tied
embeddings. Inputs: 4 random RGB images of different sizes through HF's image processor, in 2
rows of random text (vision start / end tokens around each image's placeholders).

Sections (results keyed in the JSON that rank 0 writes):
- logits[model][layout]: max |Megatron logits - HF logits| (vision tower + merger + M-RoPE LM);
- text_only[model][layout]: the same model on text only (no images, 3 packed sequences through
  `megatron_forward_logits`, 2-D positions) vs HF without images;
- roundtrip[model][layout]: HF -> Megatron -> stream -> HF, torch.equal on every rank;
- grads[layout] (PP=1, untied): max over HF tensors of |g_megatron - g_hf| / |g_hf| for the
  summed next-token log-likelihood of the images + text batch (vision tower, merger and LM);
- sp: images + text logits at TP=2 with sequence parallelism (scattered after the image merge);
- ckpt: torch_dist saved at TP=2,PP=2, loaded at TP=1,PP=2: logits vs HF, stream bit-exact;
- teeth: how far HF's own logits move when the M-RoPE ids are replaced by 1-D positions, and when
  the windowed block attends to whole images instead, so the comparisons above can see both.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from megarl.models import build_model, megatron_forward_logits
from megarl.models.vision.forward import pack_rows, vlm_forward_logits
from megarl.models.vision.mrope import mrope_position_ids
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.weights import (
    load_checkpoint_hf_config, load_hf_weights, load_megatron_checkpoint, save_megatron_checkpoint,
    stream_hf_weights)
from tests.distributed.scripts_vlm_common import make_tiny_vlm, random_batch

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODELS = {"untied": False, "tied": True}


def roundtrip(model, cfg, original: dict) -> dict:
    got, buckets = {}, 0
    for bucket in stream_hf_weights(model, cfg, bucket_bytes=16 << 10):
        buckets += 1
        for name, t in bucket:
            got[name] = t.cpu().clone()
    same_keys = set(got) == set(original)
    exact = same_keys and all(torch.equal(got[k], original[k]) for k in original)
    ok = torch.tensor([int(exact)], device=device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"exact_all_ranks": bool(ok.item()), "keys": len(got), "buckets": buckets,
            "missing": sorted(set(original) - set(got))[:5], "extra": sorted(set(got) - set(original))[:5]}


def log_likelihood(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over rows and t of log softmax(logits[:, t])[ids[:, t + 1]]."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None].to(logits.device)).sum()


def megatron_grads(model, cfg, batch) -> dict:
    """HF-named gradients of `log_likelihood` through the megatron model (PP = 1; the weights are
    overwritten by their gradients to stream them, so the model is spent afterwards)."""
    from megatron.core import tensor_parallel

    ids, pv, grid, _ = batch
    pos, _ = mrope_position_ids(ids, grid, 150, 2)
    row, pos, cu = pack_rows(ids, pos)
    from megarl.models.attention import thd_params

    chunk = model[0]
    out = chunk(row.to(device()), pos.to(device()), None, packed_seq_params=thd_params(torch.tensor(cu).to(device())),
                pixel_values=pv.to(device()), image_grid_thw=grid)
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., :160].reshape(*ids.shape, -1)
    log_likelihood(logits, ids).backward()
    with torch.no_grad():
        for p in chunk.parameters():
            p.copy_(p.grad)
    return {n: t.cpu().clone() for b in stream_hf_weights(model, cfg) for n, t in b}


def hf_refs(path: Path, batch, text_ids) -> dict:
    ids, pv, grid, mm = batch
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    logits = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm).logits
    log_likelihood(logits, ids).backward()
    # transformers 5 module names -> the checkpoint names it saves (visual.*, model.layers.*, ...)
    rename = lambda n: n.replace("model.language_model.", "model.").replace("model.visual.", "visual.")  # noqa: E731
    grads = {rename(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        out = hf_outputs(model, batch, text_ids)
    return {"logits": logits.detach().float(), "grads": grads, **out}


def hf_outputs(model, batch, text_ids) -> dict:
    ids, pv, grid, mm = batch
    out = {"text": model(input_ids=text_ids).logits}
    pos_1d = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    model.model.rope_deltas = None
    out["rope_1d"] = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, position_ids=pos_1d).logits
    model.model.visual.fullatt_block_indexes = [0, 1]
    out["no_windows"] = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm).logits
    return {k: v.float() for k, v in out.items()}


def rel_diff(got: dict, ref: dict) -> dict:
    missing = sorted(set(ref) - set(got))
    worst = max(((float((got[n] - g).norm() / g.norm()), n) for n, g in ref.items() if n in got), default=(0.0, ""))
    return {"max_rel": worst[0], "worst": worst[1], "missing": missing[:5], "n": len(ref),
            "visual": sum(n.startswith("visual.") for n in ref)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    work = Path(args.work)
    init_distributed(ParallelSizes(1, 1), seed=3)
    rank = dist.get_rank()
    if rank == 0:
        for i, (name, tie) in enumerate(MODELS.items()):
            make_tiny_vlm(work / name, seed=i, tie=tie)
    dist.barrier()
    batch = random_batch(0)
    text_ids = torch.randint(0, 150, (3, 11), generator=torch.Generator().manual_seed(1))
    refs = {name: hf_refs(work / name, batch, text_ids) for name in MODELS}
    originals = {name: load_file(work / name / "model.safetensors") for name in MODELS}
    r0 = refs["untied"]
    res = {"logits": {m: {} for m in MODELS}, "text_only": {m: {} for m in MODELS},
           "roundtrip": {m: {} for m in MODELS}, "n_image_tokens": int((batch[0] == 150).sum()),
           "grids": batch[2].tolist(), "seq": list(batch[0].shape),
           "teeth": {"rope_1d": float((r0["rope_1d"] - r0["logits"]).abs().max()),
                     "no_windows": float((r0["no_windows"] - r0["logits"]).abs().max())}}
    ids, pv, grid, _ = batch
    for tp, pp in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=3)
        layout = f"tp{tp}_pp{pp}"
        for name in MODELS:
            cfg = transformers.AutoConfig.from_pretrained(work / name)
            model = build_model(cfg)
            load_hf_weights(model, work / name)
            out = vlm_forward_logits(model, ids, pv, grid)
            ref = refs[name]["logits"]
            res["logits"][name][layout] = {"max_abs_diff": float((out - ref).abs().max()),
                                           "shape": list(out.shape), "ref_std": float(ref.std())}
            text = megatron_forward_logits(model, text_ids)
            res["text_only"][name][layout] = float((text - refs[name]["text"]).abs().max())
            res["roundtrip"][name][layout] = roundtrip(model, cfg, originals[name])
            if (tp, pp) == (2, 2) and name == "untied":
                save_megatron_checkpoint(model, work / "ckpt", cfg, hf_source_dir=work / name)
            if (tp, pp) == (2, 1) and name == "untied":  # sequence parallelism in the LM
                sp = build_model(cfg, config_overrides={"sequence_parallel": True})
                load_hf_weights(sp, work / name)
                res["sp"] = float((vlm_forward_logits(sp, ids, pv, grid) - ref).abs().max())
            if pp == 1 and name == "untied":
                res.setdefault("grads", {})[layout] = rel_diff(megatron_grads(model, cfg, batch), refs[name]["grads"])
    init_distributed(ParallelSizes(tp=1, pp=2), seed=3)
    cfg = load_checkpoint_hf_config(work / "ckpt")
    model = build_model(cfg)
    load_megatron_checkpoint(model, work / "ckpt")
    out = vlm_forward_logits(model, ids, pv, grid)
    res["ckpt"] = {"loaded_vs_hf": float((out - refs["untied"]["logits"]).abs().max()),
                   "roundtrip": roundtrip(model, cfg, originals["untied"])}
    if rank == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    main()
