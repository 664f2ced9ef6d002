"""Worker for tests/distributed/test_rollout_groups.py (4 gloo ranks).

`engine_group(2)` must pair ranks {0,1} and {2,3}; a RolloutWorker with 2 ranks per engine must
split the prompts over the 2 engines (not the 4 ranks) and keep each engine's samples once. The
engines are builtin engines on identical weights, so both ranks of a pair generate the same
samples from the same share, as an SGLang group would return its owner's samples to every rank.
"""

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.data.dataset import PromptItem
from megarl.rollout import BuiltinEngine, SamplingParams
from megarl.trainer.build import build_rewards, engine_group, load_hf_config_and_tokenizer
from megarl.trainer.generation import RolloutWorker
from tests.distributed.harness import finish, gather, parse_args


class RecordingEngine(BuiltinEngine):
    """The builtin engine, remembering which prompts this rank's engine was asked to generate."""

    asked: list[list[int]] = []

    def generate(self, prompts, sampling):
        self.asked = [list(p) for p in prompts]
        return super().generate(prompts, sampling)


def main() -> None:
    a = parse_args()
    model = str(a.root / "model")
    dist.init_process_group("gloo")
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
        worker = RolloutWorker(engine, tok, build_rewards(cfg), cfg, ranks_per_engine=per_engine)
        trajs = worker.generate(items, encoded, sampling)
        out[f"uids_{per_engine}"] = [t.uid for t in trajs]
        out[f"scored_{per_engine}"] = worker.metrics.get("reward/count", -1.0)
        out[f"asked_{per_engine}"] = sorted(tok.decode(q) for q in engine.asked)
    finish(a.out, gather(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
