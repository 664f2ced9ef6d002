"""Worker (4 gloo ranks, TP=2 x PP=2): actor weights streamed into the builtin rollout engine.

For tiny random Qwen2 and Llama 3 models: build the Megatron actor from HF, change its weights
(as training would), stream them into a `BuiltinEngine` on every rank, then
- sample at temperature 1 and compare the engine's log-probs with the actor's recomputed ones;
- compare the engine's greedy generations with HF transformers' greedy decoding of the streamed
  weights;
- stream again to the TP-rank-0 ranks only (`receive=`) and check who got what.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megarl.models import megatron_forward_logits
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.types import SamplingParams
from megarl.weights import stream_hf_weights
from tests.distributed.harness import finish, from_rank0, on_rank0, parse_args
from tests.distributed.scripts_models_common import (
    loaded, make_tiny_hf, max_logprob_diff, padded_rows, perturb, response_logprobs, tee, tiny_config)

PROMPTS = [[5, 17, 42, 8], [99, 3], [64, 65, 66, 67, 68, 2]]


def actor_logprobs(model, samples) -> list[list[float]]:
    """The actor's log-probs of each sample's response tokens."""
    return response_logprobs(megatron_forward_logits(model, padded_rows(samples)), samples)


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
    model = loaded(cfg, hf_dir)
    perturb(model[0])
    engine = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)
    streamed: dict = {}
    engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=32 << 10), streamed))
    original = BuiltinEngine.from_pretrained(hf_dir, tokenizer=None)

    # every rank recomputes rank 0's samples
    sampled = from_rank0(engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)))
    logprob_diff = max_logprob_diff(sampled, actor_logprobs(model, sampled))
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
    a = parse_args()
    init_distributed(ParallelSizes(tp=2, pp=2), seed=11)
    on_rank0(lambda: [make_tiny_hf(fam, a.root / fam, seed=20 + i) for i, fam in enumerate(("qwen2", "llama3"))])
    finish(a.out, {fam: run_family(fam, a.root / fam) for fam in ("qwen2", "llama3")})


if __name__ == "__main__":
    main()
