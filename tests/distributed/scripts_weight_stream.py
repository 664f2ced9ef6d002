"""Worker (4 gloo ranks, TP=2 x PP=2): actor weights streamed into the builtin rollout engine.

For tiny random Qwen2 and Llama 3 models: build the Megatron actor from HF, change its weights
(as training would), stream them into a `BuiltinEngine` on every rank, then
- sample at temperature 1 and compare the engine's log-probs with the actor's recomputed ones;
- compare the engine's greedy generations with HF transformers' greedy decoding of the streamed
  weights;
- stream again to the TP-rank-0 ranks only (`receive=`) and check who got what.
"""

import argparse
import json
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megarl.models import build_model, megatron_forward_logits
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.weights import load_hf_weights, stream_hf_weights
from tests.distributed.scripts_models_common import make_tiny_hf, tiny_config

PROMPTS = [[5, 17, 42, 8], [99, 3], [64, 65, 66, 67, 68, 2]]


@torch.no_grad()
def perturb(model) -> None:
    """Deterministic multiplicative noise; the same per name on every TP rank, so replicated
    parameters stay identical across TP ranks."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen).to(p.device))


def tee(stream, sink: dict):
    for bucket in stream:
        for name, t in bucket:
            sink[name] = t.cpu()
        yield bucket


def actor_logprobs(model, samples) -> list[list[float]]:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    logp = torch.log_softmax(megatron_forward_logits(model, ids), dim=-1)
    out = []
    for row, s in enumerate(samples):
        start = len(s.prompt_ids)
        pos = torch.arange(start - 1, start - 1 + len(s.response_ids))
        out.append(logp[row, pos, torch.tensor(s.response_ids)].tolist())
    return out


def hf_greedy(cfg, tensors: dict, eos: list[int], max_new: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    outs = []
    for p in PROMPTS:
        ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos or None, pad_token_id=0, attention_mask=torch.ones(1, len(p)))
        outs.append(ids[0, len(p):].tolist())
    return outs


def run_family(family: str, hf_dir: Path) -> dict:
    from megatron.core import parallel_state as ps

    cfg = tiny_config(family)
    model = build_model(cfg)
    load_hf_weights(model, hf_dir)
    perturb(model[0])
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    streamed: dict = {}
    engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=32 << 10), streamed))
    original = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)

    sampled = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7))
    obj = [sampled]
    dist.broadcast_object_list(obj, src=0)  # every rank recomputes rank 0's samples
    sampled = obj[0]
    recomputed = actor_logprobs(model, sampled)
    logprob_diff = max(abs(a - b) for s, r in zip(sampled, recomputed) for a, b in zip(s.logprobs, r))
    n_tokens = sum(len(s.response_ids) for s in sampled)
    # the same samples under the un-streamed (HF-file) weights differ: the stream changed them
    stale = original.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7))

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine_greedy = [s.response_ids for s in engine.generate(PROMPTS, greedy)]
    hf_out = hf_greedy(cfg, streamed, list(engine.eos_token_ids), 8)

    tp0 = ps.get_tensor_model_parallel_rank() == 0
    got = {n: t.cpu() for b in stream_hf_weights(model, cfg, bucket_bytes=32 << 10, receive=tp0)
           for n, t in b}
    partial_ok = (set(got) == set(streamed) and all(torch.equal(got[k], streamed[k]) for k in got)
                  if tp0 else not got)
    flag = torch.tensor([int(partial_ok)], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return {
        "logprob_max_abs_diff": logprob_diff, "n_sampled_tokens": n_tokens,
        "stale_weights_differ": [s.response_ids for s in stale] != [s.response_ids for s in sampled]
        or max(abs(a - b) for s, t in zip(sampled, stale) for a, b in zip(s.logprobs, t.logprobs)) > 1e-3,
        "engine_greedy": engine_greedy, "hf_greedy": hf_out,
        "weight_version": engine.weight_version, "receive_subset_ok": bool(flag.item()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    work = Path(args.work)
    init_distributed(ParallelSizes(tp=2, pp=2), seed=11)
    if dist.get_rank() == 0:
        for i, fam in enumerate(("qwen2", "llama3")):
            make_tiny_hf(fam, work / fam, seed=20 + i)
    dist.barrier()
    res = {fam: run_family(fam, work / fam) for fam in ("qwen2", "llama3")}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    main()
