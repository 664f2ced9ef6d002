"""Worker for tests/distributed/test_data_formats.py (2 gloo ranks, DP=2).

The arith task's training rows as native JSONL, verl parquet, slime JSONL, a
datasets.save_to_disk folder and a dataset in the HF cache (by name, HF_DATASETS_OFFLINE=1 and
HF_DATASETS_CACHE set by the test) each train 2 GRPO steps of the RL loop from the same tiny
model -> each run's training prompt ids (in the sampler's order) and metrics rows.
"""

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megarl.config import load_config  # noqa: E402
from megarl.parallel.distributed import ParallelSizes, init_distributed  # noqa: E402
from tests.unit import formats_fixtures as F  # noqa: E402


def score(x, **_) -> float:
    """A reward that depends on the row's prompt and answer and on the response, so that the
    untrained tiny model's samples score differently (the arith verifier gives them all -1)."""
    return float((len(x.response) + len(x.prompt) + int(x.gold)) % 2)


def write_inputs(root: Path, cache: Path) -> dict[str, list[str]]:
    """The tiny model, the task and its train rows in every layout -> overrides reading each."""
    from megarl.tasks.arith import write_task_files
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    train = root / "task" / "train.jsonl"
    if dist.get_rank() == 0:
        write_task_files(root / "task", n_sft=1, n_train=16, n_eval=1, seed=0)
        rows = F.read_rows(train)
        save_tiny_model(root / "model", TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=0))
        F.write_verl_parquet(rows, root / "verl.parquet")
        F.write_slime_jsonl(rows, root / "slime.jsonl")
        F.write_save_to_disk(rows, root / "saved")
        F.build_hf_cache({"train": rows}, cache)
    dist.barrier()
    return {"native": [f"data.train_path={train}"],
            "verl": [f"data.train_path={root / 'verl.parquet'}", "data.prompt_key=prompt",
                     "data.answer_key=reward_model.ground_truth"],
            "slime": [f"data.train_path={root / 'slime.jsonl'}", "data.prompt_key=prompt", "data.answer_key=label"],
            "save_to_disk": [f"data.train_path={root / 'saved'}"],
            "hf_cache": ["data.train_path=hf:me/tiny-arith?split=train"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True, type=Path)
    p.add_argument("--cache", required=True, type=Path)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    init_distributed(ParallelSizes(), seed=0)
    runs = write_inputs(a.root, a.cache)
    from megarl.trainer import build
    from megarl.trainer.loop import train

    res = {}
    for name, over in runs.items():
        cfg = load_config(None, [f"model.hf_path={a.root / 'model'}", *a.overrides, *over,
                                 f"trainer.run_dir={a.root / 'runs' / name}"])
        train(cfg)
        if dist.get_rank() == 0:
            _, tok = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
            data = build.build_data(cfg, tok)
            order = data.train.epoch_order(0)
            items = data.train.dataset
            res[name] = {"prompt_ids": [items[i].prompt_ids for i in order],
                         "answers": [items[i].answer for i in order],
                         "rows": [json.loads(x) for x in (a.root / "runs" / name / "metrics.jsonl").read_text().splitlines()]}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    main()
