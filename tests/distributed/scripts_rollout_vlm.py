"""Worker (2 gloo ranks, TP=2, strict device mode): a Megatron Qwen2.5-VL's weights streamed into the
builtin rollout engine, which then generates with images.

A tiny random qwen2_5_vl (tests/distributed/scripts_vlm_common.py): build the Megatron model from HF,
change every weight (as training would), stream its HF-named tensors (vision tower, merger, LM) into a
`BuiltinEngine` loaded from the HF files, then
- sample (temperature 1, n=2) and greedy-decode prompts with one image, two images of other sizes,
  and no image; every rank recomputes rank 0's samples through the Megatron model
  (`megarl.models.vision.forward.vlm_forward_logits`: rows of prompt + response, their images in row
  order) and compares per-token log-probs;
- record what the stream carried (names, bucket count) and teeth: the un-streamed engine samples
  differently, and an engine whose LM is streamed but whose vision tower keeps the HF-file weights
  scores the first response token differently.
"""

import torch

from megarl.models.vision.forward import vlm_forward_logits
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.weights import stream_hf_weights
from tests.distributed.harness import finish, from_rank0, parse_args
from tests.distributed.scripts_models_common import (
    loaded, max_logprob_diff, padded_rows, perturb, response_logprobs, tee)
from tests.distributed.scripts_vlm_common import IMAGE, make_prompt, shared_tiny_vlm

MAX_NEW = 6


def megatron_logprobs(model, samples, images) -> list[list[float]]:
    """Log-probs of each sample's response tokens under the Megatron model: one row per sample
    (prompt + response, right-padded with token 0), the rows' images concatenated in row order."""
    rows = [images[s.index] for s in samples if images[s.index] is not None]
    pv = torch.cat([r["pixel_values"] for r in rows]) if rows else None
    grid = torch.cat([r["image_grid_thw"] for r in rows]) if rows else None
    return response_logprobs(vlm_forward_logits(model, padded_rows(samples), pv, grid), samples)


def main():
    a = parse_args()
    init_distributed(ParallelSizes(tp=2, pp=1), seed=11)
    hf_dir = a.root / "hf"
    cfg = shared_tiny_vlm(hf_dir)
    model = loaded(cfg, hf_dir)
    perturb(model[0])

    made = [make_prompt([(20, 37)], 1), make_prompt([(48, 40), (9, 9)], 2), make_prompt([], 3)]
    prompts, images = [m[0] for m in made], [m[1] for m in made]
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    streamed, buckets = {}, []
    engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=16 << 10), streamed, buckets))

    res = {"stream": {"n": len(streamed), "visual": sorted(n for n in streamed if n.startswith("visual.")),
                      "buckets": len(buckets), "engine_params": sorted(engine.model.state_dict()),
                      "names": sorted(streamed)},
           "weight_version": engine.weight_version}
    for mode, sampling in (("sampled", SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=7)),
                           ("greedy", SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))):
        samples = from_rank0(engine.generate(prompts, sampling, images=images))  # every rank recomputes them
        assert not any(IMAGE in s.response_ids for s in samples)  # placeholders only in the prompts
        ref = megatron_logprobs(model, samples, images)
        res[mode] = {"logprob_max_abs_diff": max_logprob_diff(samples, ref),
                     "n_tokens": sum(len(s.response_ids) for s in samples),
                     "with_images": sum(images[s.index] is not None for s in samples),
                     "responses": [s.response_ids for s in samples]}

    # teeth: the HF-file weights sample differently; the streamed LM with the HF-file vision tower
    # scores the first greedy token of the image prompts differently
    original = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    stale = original.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=7),
                              images=images)
    res["stale_differs"] = [s.response_ids for s in stale] != res["sampled"]["responses"]
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    original.update_weights([[(n, t) for n, t in streamed.items() if not n.startswith("visual.")]], strict=False)
    lm_only = original.generate(prompts[:2], one, images=images[:2])
    full = engine.generate(prompts[:2], one, images=images[:2])
    res["stale_vision_first_logprob_diff"] = max(
        abs(a.logprobs[0] - b.logprobs[0]) + float(a.response_ids != b.response_ids) for a, b in zip(lm_only, full))
    finish(a.out, res)


if __name__ == "__main__":
    main()
