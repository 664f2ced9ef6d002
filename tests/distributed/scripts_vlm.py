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

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from megarl.models import build_model, megatron_forward_logits
from megarl.models.vision.forward import vlm_forward_logits
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.weights import load_checkpoint_hf_config, load_megatron_checkpoint, save_megatron_checkpoint
from tests.distributed.harness import finish, on_rank0, parse_args
from tests.distributed.scripts_models_common import check_layout, loaded, max_abs, roundtrip
from tests.distributed.scripts_vlm_common import log_likelihood, make_tiny_vlm, megatron_grads, random_batch, rel_diff

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODELS = {"untied": False, "tied": True}


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


def main():
    a = parse_args()
    work = a.root
    init_distributed(ParallelSizes(1, 1), seed=3)
    on_rank0(lambda: [make_tiny_vlm(work / name, seed=i, tie=tie) for i, (name, tie) in enumerate(MODELS.items())])
    batch = random_batch(0)
    text_ids = torch.randint(0, 150, (3, 11), generator=torch.Generator().manual_seed(1))
    refs = {name: hf_refs(work / name, batch, text_ids) for name in MODELS}
    originals = {name: load_file(work / name / "model.safetensors") for name in MODELS}
    r0 = refs["untied"]
    res = {"logits": {m: {} for m in MODELS}, "text_only": {m: {} for m in MODELS},
           "roundtrip": {m: {} for m in MODELS}, "n_image_tokens": int((batch[0] == 150).sum()),
           "grids": batch[2].tolist(), "seq": list(batch[0].shape),
           "teeth": {k: max_abs(r0[k], r0["logits"]) for k in ("rope_1d", "no_windows")}}
    ids, pv, grid, _ = batch
    for tp, pp in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp), seed=3)
        layout = f"tp{tp}_pp{pp}"
        for name in MODELS:
            cfg, ref = transformers.AutoConfig.from_pretrained(work / name), refs[name]["logits"]
            model, _, res["logits"][name][layout], res["roundtrip"][name][layout] = check_layout(
                cfg, work / name, lambda m: vlm_forward_logits(m, ids, pv, grid), ref, originals[name], 16 << 10)
            res["text_only"][name][layout] = max_abs(megatron_forward_logits(model, text_ids), refs[name]["text"])
            if (tp, pp) == (2, 2) and name == "untied":
                save_megatron_checkpoint(model, work / "ckpt", cfg, hf_source_dir=work / name)
            if (tp, pp) == (2, 1) and name == "untied":  # sequence parallelism in the LM
                sp = loaded(cfg, work / name, config_overrides={"sequence_parallel": True})
                res["sp"] = max_abs(vlm_forward_logits(sp, ids, pv, grid), ref)
            if pp == 1 and name == "untied":
                res.setdefault("grads", {})[layout] = rel_diff(megatron_grads(model, cfg, batch), refs[name]["grads"],
                                                               "visual.")
    init_distributed(ParallelSizes(tp=1, pp=2), seed=3)
    cfg = load_checkpoint_hf_config(work / "ckpt")
    model = build_model(cfg)
    load_megatron_checkpoint(model, work / "ckpt")
    out = vlm_forward_logits(model, ids, pv, grid)
    res["ckpt"] = {"loaded_vs_hf": max_abs(out, refs["untied"]["logits"]),
                   "roundtrip": roundtrip(model, cfg, originals["untied"], 16 << 10)}
    finish(a.out, res)


if __name__ == "__main__":
    main()
