"""Worker (4 gloo ranks, strict device mode): Qwen3-VL-MoE HF <-> Megatron across TP / PP / EP layouts.

Model (`make_tiny_vlm_moe`): a tiny random qwen3_vl_moe, saved by HF and then with its fused expert
tensors in the layout of the released checkpoints ([E, H, 2I] / [E, I, H]; HF 5.19 saves [E, 2I, H]
/ [E, H, I] and reads both). LM: 4 layers, hidden 64, GQA 4/2 heads of head_dim 32 (q/k norms),
6 experts (not a power of two) top-2 of size 24, interleaved M-RoPE sections [6, 5, 5], vocabulary 160
(TP padding exercised); vision: 3 blocks (hidden 32, 2 heads, tanh-GELU MLP 48), patch 4, merge 2, a
6 x 6 learned position table (images both smaller and larger than it), DeepStack after blocks 0 and 1
(added after LM layers 0 and 1, both on the first of 2 pipeline stages). Inputs: 4 random RGB images
of different sizes through HF's image processor in 2 rows of random text (scripts_vlm_common).

Sections (results keyed in the JSON that rank 0 writes):
- logits[layout]: max |Megatron logits - HF logits| with images (tower, DeepStack, MoE LM);
- text_only[layout]: 3 text-only sequences (packed, 2-D positions) vs HF without images;
- roundtrip[layout]: HF -> Megatron -> stream -> HF, torch.equal with the checkpoint on every rank;
- grads[layout]: max over HF tensors of |g_megatron - g_hf| / |g_hf| for the summed next-token
  log-likelihood of the images + text batch, at TP1 (also with full activation recompute) and at TP2
  with sequence parallelism;
- sp: images + text logits at TP2 with sequence parallelism;
- hf_layout: HF reads our legacy-layout file into the same weights as the model it saved;
- pp_error: the build-time error when the DeepStack layers would not fit on the first PP stage;
- teeth: how far HF's own logits move without DeepStack, with contiguous (Qwen2.5-VL) M-RoPE sections,
  and without the learned position table, so the comparisons above can see each.
"""

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.distributed.harness import finish, on_rank0, parse_args
from tests.distributed.scripts_models_common import check_layout, loaded, max_abs, save_random
from tests.distributed.scripts_vlm_common import (
    IMAGE, VEND, VIDEO, VSTART, log_likelihood, megatron_grads, random_batch, rel_diff)

# (tp, pp, ep)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def tiny_vlm_moe_config(deepstack=(0, 1), num_layers: int = 4):
    return transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=6, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5], "rope_theta": 1000.0,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=36, deepstack_visual_indexes=list(deepstack)),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=False)


def to_released_expert_layout(path: Path) -> None:
    """Rewrites HF 5.19's in-memory expert layout ([E, 2I, H], [E, H, I]) of `path`'s safetensors
    file as the released checkpoints store it ([E, H, 2I], [E, I, H])."""
    f = path / "model.safetensors"
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})


def make_tiny_vlm_moe(path, seed: int = 0) -> Path:
    # norm biases (1-D) are drawn N(0, 0.1) like every other 1-D parameter
    model = save_random(lambda: transformers.Qwen3VLMoeForConditionalGeneration(tiny_vlm_moe_config()).float(), path,
                        seed, norm=lambda name: "norm" in name and name.endswith("weight"))
    to_released_expert_layout(Path(path))
    torch.save(model.state_dict(), Path(path).parent / f"{Path(path).name}_state.pt")
    return Path(path)


def hf_model(path: Path):
    return transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def contiguous_sections(rotary):
    """Qwen2.5-VL's M-RoPE frequency assignment (first s_t to t, next s_h to h, last s_w to w), for
    HF's rotary module in place of its interleaved `recomposition_frequencies`."""
    def recompose(freq):
        f = torch.cat([part[i % 3] for i, part in enumerate(freq.split(list(rotary.mrope_section), dim=-1))], -1)
        return torch.cat([f, f], dim=-1)

    return recompose


def hf_refs(path: Path, batch, text_ids) -> dict:
    """HF logits with images (and the gradients of their log-likelihood, checkpoint names and layout),
    text-only logits, and the teeth variants' logits."""
    ids, pv, grid, mm = batch
    images = dict(pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm)
    model = hf_model(path)
    logits = model(input_ids=ids, **images).logits
    log_likelihood(logits, ids).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n in [n for n in grads if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        grads[n] = grads[n].transpose(1, 2)  # checkpoint layout, as the weight stream writes it
    out = {"logits": logits.detach(), "grads": grads}
    with torch.no_grad():
        out["text"] = model(input_ids=text_ids).logits
        model.model.visual.deepstack_visual_indexes = []
        out["no_deepstack"] = model(input_ids=ids, **images).logits
        model = hf_model(path)
        rotary = model.model.language_model.rotary_emb
        rotary.recomposition_frequencies = contiguous_sections(rotary)
        out["contiguous_mrope"] = model(input_ids=ids, **images).logits
        model = hf_model(path)
        model.model.visual.pos_embed.weight.zero_()
        out["no_position_table"] = model(input_ids=ids, **images).logits
    return out


def main():
    from megarl.models import build_model, megatron_forward_logits
    from megarl.models.vision.forward import vlm_forward_logits
    from megarl.parallel.distributed import ParallelSizes, init_distributed

    a = parse_args()
    work = a.root
    init_distributed(ParallelSizes(), seed=3)
    on_rank0(make_tiny_vlm_moe, work / "hf", seed=0)
    hf_dir, batch = work / "hf", random_batch(0)
    ids, pv, grid, _ = batch
    text_ids = torch.randint(0, 150, (3, 11), generator=torch.Generator().manual_seed(1))
    ref = hf_refs(hf_dir, batch, text_ids)
    original = load_file(hf_dir / "model.safetensors")
    saved = torch.load(work / "hf_state.pt", weights_only=True)
    res = {"logits": {}, "text_only": {}, "roundtrip": {}, "grads": {}, "grids": grid.tolist(),
           "seq": list(ids.shape), "n_image_tokens": int((ids == IMAGE).sum()), "ref_std": float(ref["logits"].std()),
           "hf_layout": all(torch.equal(saved[k], v) for k, v in hf_model(hf_dir).state_dict().items()),
           "teeth": {k: max_abs(ref[k], ref["logits"])
                     for k in ("no_deepstack", "contiguous_mrope", "no_position_table")}}
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)

    def grads(model) -> dict:
        model[0].train()
        return rel_diff(megatron_grads(model, cfg, batch), ref["grads"], "model.visual.")

    for tp, pp, ep in LAYOUTS:
        init_distributed(ParallelSizes(tp=tp, pp=pp, ep=ep), seed=3)
        layout = f"tp{tp}_pp{pp}_ep{ep}"
        model, _, res["logits"][layout], res["roundtrip"][layout] = check_layout(
            cfg, hf_dir, lambda m: vlm_forward_logits(m, ids, pv, grid), ref["logits"], original, 16 << 10)
        res["text_only"][layout] = max_abs(megatron_forward_logits(model, text_ids), ref["text"])
        if (tp, pp, ep) == (1, 1, 1):
            res["grads"][layout] = grads(model)
            # full activation recompute re-runs each layer in backward: DeepStack must be re-added
            res["grads"][layout + "_recompute"] = grads(loaded(cfg, hf_dir, config_overrides=RECOMPUTE))
        if (tp, pp, ep) == (2, 1, 1):  # sequence parallelism: DeepStack rows of this rank's slice
            sp = loaded(cfg, hf_dir, config_overrides={"sequence_parallel": True})
            res["sp"] = max_abs(vlm_forward_logits(sp, ids, pv, grid), ref["logits"])
            # megatron refuses to train MoE under TP without sequence parallelism
            res["grads"][layout + "_sp"] = grads(sp)
        if (tp, pp, ep) == (1, 2, 1):  # 3 DeepStack layers cannot all sit on a stage of 2 layers
            try:
                build_model(tiny_vlm_moe_config(deepstack=(0, 1, 2)))
                res["pp_error"] = ""
            except ValueError as e:
                res["pp_error"] = str(e)
    finish(a.out, res)


if __name__ == "__main__":
    main()
