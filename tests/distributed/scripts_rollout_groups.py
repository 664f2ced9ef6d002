"""Worker for tests/distributed/test_rollout_groups.py (4 gloo ranks).

`engine_group(2)` must pair ranks {0,1} and {2,3}; a RolloutWorker with 2 ranks per engine must
split the prompts over the 2 engines (not the 4 ranks), have only each engine's owner (ranks 0
and 2) generate and keep its samples, every rank learn every row's metadata, and an error on an
owner raise on both ranks of its pair. The engines are builtin engines on identical weights
standing in for SGLang engines (whose owner drives the group's GPUs).

Also, per pair: `lockstep` over rank-dependent weight streams (ranks of an engine with expert
parallelism get different tensors: every rank goes through the same rounds), and an SGLangEngine
over 2 "nodes" of 1 GPU each (a stand-in `sglang` module records what each Engine() got): both
ranks start one, as node 0 and node 1, joining the owner's address, node 1 with
SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0; a failing node raises on both ranks.
"""

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.parallel.distributed import destroy_distributed, init_distributed
from megarl.data.dataset import PromptItem
from megarl.rollout import BuiltinEngine, SamplingParams
from megarl.trainer.build import build_rewards, engine_group, load_hf_config_and_tokenizer
from megarl.trainer.generation import RolloutWorker
from tests.distributed.harness import finish, gather, parse_args


class RecordingEngine(BuiltinEngine):
    """The builtin engine, remembering which prompts this rank's engine was asked to generate."""

    asked: list[list[int]] = []

    def generate(self, prompts, sampling):
        if getattr(self, "fail", False):
            raise RuntimeError("engine failed on purpose")
        self.asked = [list(p) for p in prompts]
        return super().generate(prompts, sampling)


def main() -> None:
    a = parse_args()
    model = str(a.root / "model")
    init_distributed()
    group = engine_group(2)
    members = dist.get_process_group_ranks(group)

    from transformers import AutoModelForCausalLM

    hf_config, tok = load_hf_config_and_tokenizer(model)
    engine = RecordingEngine(config=hf_config, tokenizer=tok)
    engine.update_weights([list(AutoModelForCausalLM.from_pretrained(model).state_dict().items())])
    cfg = load_config(None, ["reward.sources={arith: math}", "algorithm.overlong_penalty=false"])
    items = [PromptItem(uid=f"u{i}", prompt=f"{i}+{i}", answer=str(2 * i), data_source="arith") for i in range(6)]
    encoded = [tok.encode(f"Q: {it.prompt}=?\n") for it in items]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=5)
    out = {"members": members}
    for per_engine in (1, 2):
        engine.asked, engine.group = [], group if per_engine == 2 else None
        worker = RolloutWorker(engine, tok, build_rewards(cfg), cfg, ranks_per_engine=per_engine)
        rows = worker.generate(items, encoded, sampling)
        out[f"uids_{per_engine}"] = [m.uid for m in rows]
        out[f"sources_{per_engine}"] = sorted({m.source for m in rows})
        out[f"held_{per_engine}"] = len(worker.store)
        out[f"scored_{per_engine}"] = worker.metrics.get("reward/count", -1.0)
        out[f"asked_{per_engine}"] = sorted(tok.decode(q) for q in engine.asked)
    engine.fail = dist.get_rank() % 2 == 0  # the owners fail: the other rank of each pair must raise too
    try:
        worker.generate(items, encoded, sampling)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    out["lockstep"] = lockstep_rounds(group)
    out["nodes"] = multi_node_start(group, a.root)
    finish(a.out, gather(out))
    destroy_distributed()


def lockstep_rounds(group) -> list:
    """The rounds each rank of the pair sees when the owner's stream has 3 buckets and the other's 1."""
    from megarl.rollout.sglang.requests import lockstep, with_last_flag

    n = 3 if dist.get_rank(group) == 0 else 1
    return [(len(b), more) for b, more in lockstep(with_last_flag([[("w", i)] for i in range(n)]), group)]


class NodeEngine:
    """A stand-in sglang.Engine: records its keywords and whether the follower flag was set."""

    made: list = []

    def __init__(self, **kwargs):
        import os

        if kwargs.get("node_rank") == 1 and os.environ.get("FAIL_NODE") == "1":
            raise RuntimeError("node 1 failed on purpose")
        NodeEngine.made.append({"node_rank": kwargs.get("node_rank"), "nnodes": kwargs.get("nnodes"),
                                "addr": kwargs.get("dist_init_addr"),
                                "follower_env": os.environ.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")})

    def shutdown(self):
        pass


def multi_node_start(group, root) -> dict:
    import os
    import types

    from megarl.rollout.sglang.engine import SGLangEngine
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    model = root / "sglang_model"
    if dist.get_rank() == 0:
        save_tiny_model(model, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64))
    dist.barrier()
    sglang = types.SimpleNamespace(Engine=NodeEngine, __version__="0.5.23")
    out = {}
    for fail in ("0", "1"):
        os.environ["FAIL_NODE"] = fail
        NodeEngine.made = []
        engine = SGLangEngine(model, group=group, sglang_module=sglang, base_gpu_id=0, nnodes=2)
        try:
            engine.start()
            out[f"fail{fail}"] = {"made": NodeEngine.made, "owner_engine": engine._engine is not None,
                                  "env_after": os.environ.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")}
        except RuntimeError as e:
            out[f"fail{fail}"] = {"raised": str(e)}
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
