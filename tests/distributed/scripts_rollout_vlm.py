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

import argparse
import json
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megarl.models import build_model
from megarl.models.vision.forward import vlm_forward_logits
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.weights import load_hf_weights, stream_hf_weights
from tests.distributed.scripts_vlm_common import IMAGE, make_prompt, make_tiny_vlm

MAX_NEW = 6


@torch.no_grad()
def perturb(model) -> None:
    """Deterministic multiplicative noise, the same per name on every TP rank (replicated
    parameters stay identical across TP ranks)."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen).to(p.device))


def tee(stream, sink: dict, counter: list):
    for bucket in stream:
        counter.append(len(bucket))
        for name, t in bucket:
            sink[name] = t.cpu().clone()
        yield bucket


def megatron_logprobs(model, samples, images) -> list[list[float]]:
    """Log-probs of each sample's response tokens under the Megatron model: one row per sample
    (prompt + response, right-padded with token 0), the rows' images concatenated in row order."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    rows = [images[s.index] for s in samples if images[s.index] is not None]
    pv = torch.cat([r["pixel_values"] for r in rows]) if rows else None
    grid = torch.cat([r["image_grid_thw"] for r in rows]) if rows else None
    logp = torch.log_softmax(vlm_forward_logits(model, ids, pv, grid), dim=-1)
    out = []
    for row, s in enumerate(samples):
        p = len(s.prompt_ids)
        pos = torch.arange(p - 1, p - 1 + len(s.response_ids))
        out.append(logp[row, pos, torch.tensor(s.response_ids)].tolist())
    return out


def max_diff(samples, ref) -> float:
    return max(abs(a - b) for s, r in zip(samples, ref) for a, b in zip(s.logprobs, r))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    work = Path(args.work)
    init_distributed(ParallelSizes(tp=2, pp=1), seed=11)
    hf_dir = work / "hf"
    if dist.get_rank() == 0:
        make_tiny_vlm(hf_dir, seed=3)
    dist.barrier()
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_model(cfg)
    load_hf_weights(model, hf_dir)
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
        samples = engine.generate(prompts, sampling, images=images)
        obj = [samples]
        dist.broadcast_object_list(obj, src=0)  # every rank recomputes rank 0's samples
        samples = obj[0]
        assert not any(IMAGE in s.response_ids for s in samples)  # placeholders only in the prompts
        ref = megatron_logprobs(model, samples, images)
        res[mode] = {"logprob_max_abs_diff": max_diff(samples, ref),
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
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    main()
