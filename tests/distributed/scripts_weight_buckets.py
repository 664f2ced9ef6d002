"""Worker for tests/distributed/test_weight_buckets.py (4 gloo ranks, TP=2 x EP=2, expert-TP 2): a
tiny qwen3_moe whose experts are large against the weight stream's bucket (one expert's three
fc1 (gate + up) 2/3 of a bucket).

- sync: the HF weights streamed into the builtin engine on every rank; the engine's tensors
  against the HF files (bit for bit), and the largest buffer any collective of the stream moved
  on this rank, recorded by wrapping torch.distributed's all_gather / broadcast / send / recv
  (independent of the stream's own accounting);
- selective: rank r wants only the experts e with e % 4 == r: which HF names it got, equal to the
  files, and the bytes the expert delivery sent it;
- dense_tp2_pp2: a tiny dense qwen2 at TP=2 x PP=2, streamed in 96 KiB buckets: what the stream
  allocated for its busiest bucket (StreamStats.peak_bytes) and that bucket's HF bytes, for the
  planner's formula (megarl.planner.stream_transient_bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.parallel import exchange
from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.rollout.builtin import BuiltinEngine
from megarl.weights import stream_hf_weights
from megarl.weights.stream import StreamStats
from tests.distributed.harness import finish, gather, on_rank0, parse_args
from tests.distributed.scripts_models_common import loaded, tee
from tests.distributed.scripts_moe import make_tiny_moe, tiny_moe_config

EXPERT_FFN, HIDDEN = 192, 64
FC1 = 2 * EXPERT_FFN * HIDDEN * 4  # fp32 bytes of one expert's gate and up (megatron's fused fc1)
BUCKET = 3 * FC1 // 2  # one expert's fc1 fits, the same fc1 slot of both EP ranks does not


class LargestBuffer:
    """Records the largest tensor (or tensor list, summed) torch.distributed moves meanwhile."""

    NAMES = ("all_gather", "broadcast", "send", "recv", "all_gather_into_tensor")  # P2POps: see __enter__

    def __init__(self):
        self.largest = 0

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self.saved.items():
            setattr(dist, n, self._wrap(fn))
        self.saved_p2p = dist.P2POp.__init__
        outer = self

        def p2p_init(op_self, op, tensor, *args, **kwargs):
            outer.largest = max(outer.largest, tensor.numel() * tensor.element_size())
            return outer.saved_p2p(op_self, op, tensor, *args, **kwargs)

        dist.P2POp.__init__ = p2p_init
        return self

    def _wrap(self, fn):
        def wrapper(first, *args, **kwargs):
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.largest = max(self.largest, sum(t.numel() * t.element_size() for t in tensors))
            return fn(first, *args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)
        dist.P2POp.__init__ = self.saved_p2p


def main():
    a = parse_args()
    path = a.root / "moe"
    init_distributed(ParallelSizes(tp=2, ep=2), seed=3)
    on_rank0(make_tiny_moe, "qwen3_moe", path, seed=2, moe_intermediate_size=EXPERT_FFN, hidden_size=HIDDEN,
             num_experts=8)
    cfg = tiny_moe_config("qwen3_moe", moe_intermediate_size=EXPERT_FFN, hidden_size=HIDDEN, num_experts=8)
    files = load_file(path / "model.safetensors")
    model = loaded(cfg, path)
    expert_bytes = 3 * EXPERT_FFN * HIDDEN * 4

    engine = BuiltinEngine.from_pretrained(path, tokenizer=None)
    with torch.no_grad():
        for p in engine.model.parameters():  # the engine must get every tensor from the stream
            p.zero_()
    streamed: dict = {}
    stats = StreamStats()
    with LargestBuffer() as seen:
        engine.update_weights(tee(stream_hf_weights(model, cfg, bucket_bytes=BUCKET, stats=stats), streamed))
    state = dict(engine.model.state_dict())
    sync = {"names_equal_files": sorted(streamed) == sorted(files),
            "streamed_equal_files": all(torch.equal(streamed[k], files[k]) for k in files),
            "engine_equal_files": all(torch.equal(state[k], files[k]) for k in files if k in state),
            "engine_tensors_checked": sum(k in state for k in files),
            "largest_collective_buffer": seen.largest, "stats_largest": stats.largest_buffer,
            "stats_peak": stats.peak_bytes, "buckets": stats.buckets, "bucket_bytes": BUCKET,
            "expert_bytes": expert_bytes, "fc1_bytes": FC1}

    rank = dist.get_rank()
    exchange.reset_traffic()
    got = {n: t.cpu().clone() for b in stream_hf_weights(model, cfg, bucket_bytes=BUCKET,
                                                   want_expert=lambda layer, e: e % 4 == rank, receive=False)
           for n, t in b}
    experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in got if ".experts." in n})
    selective = {"experts": experts, "only_experts": all(".experts." in n for n in got),
                 "equal_files": all(torch.equal(t, files[n]) for n, t in got.items()),
                 "tensors": len(got), "bytes_received": sum(exchange.traffic().get(p, {}).get("weights", 0)
                                                            for p in exchange.traffic())}
    finish(a.out, gather({"sync": sync, "selective": selective, "dense_tp2_pp2": dense_stream(a.root)}))


def dense_stream(root) -> dict:
    from tests.distributed.scripts_models_common import make_tiny_hf, tiny_config

    init_distributed(ParallelSizes(tp=2, pp=2), seed=3)
    on_rank0(make_tiny_hf, "qwen2", root / "dense", hidden=64, layers=4)
    cfg = tiny_config("qwen2")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers = 64, 128, 16, 4
    model = loaded(cfg, root / "dense")
    stats = StreamStats()
    sizes = [sum(t.numel() * t.element_size() for _, t in b)
             for b in stream_hf_weights(model, cfg, bucket_bytes=96 << 10, stats=stats)]
    return {"peak": stats.peak_bytes, "largest_bucket": max(sizes), "bucket_bytes": 96 << 10}


if __name__ == "__main__":
    main()
