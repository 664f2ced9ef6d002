"""Worker for tests/unit/test_bad_input_checkpoint.py (one process, gloo, the CPU runtime): a
megarl torch_dist checkpoint of model A is loaded into A (control), into a model B of another
size, and, with one shard file cut short, into A again. Writes the outcomes as JSON."""

import json
import shutil
import sys
from pathlib import Path

from transformers import AutoConfig

from megarl.models import build_model
from megarl.parallel.distributed import ParallelSizes, destroy_distributed, init_distributed
from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model
from megarl.weights import load_hf_weights, load_megatron_checkpoint, save_megatron_checkpoint
from megarl.weights.hf_reader import CheckpointError


def attempt(fn) -> str:
    try:
        fn()
        return "ok"
    except CheckpointError as e:
        return f"CheckpointError: {e}"


def main(root: Path, out: Path) -> None:
    init_distributed(ParallelSizes(), seed=0)
    specs = {"a": TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=0),
             "b": TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=1)}
    configs = {}
    for name, spec in specs.items():
        save_tiny_model(root / f"hf_{name}", spec)
        configs[name] = AutoConfig.from_pretrained(root / f"hf_{name}")
    model_a = build_model(configs["a"], dtype="fp32")
    load_hf_weights(model_a, root / "hf_a")
    save_megatron_checkpoint(model_a, root / "ckpt_a", configs["a"], hf_source_dir=root / "hf_a")
    shutil.copytree(root / "ckpt_a", root / "ckpt_cut")
    shard = max((root / "ckpt_cut" / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    def load(model: str, ckpt: str):
        return attempt(lambda: load_megatron_checkpoint(build_model(configs[model], dtype="fp32"), root / ckpt))

    res = {
        "same_model": load("a", "ckpt_a"), "other_model": load("b", "ckpt_a"), "cut_shard": load("a", "ckpt_cut"),
        "cut_shard_path": str(shard), "cut_shard_size": shard.stat().st_size,
    }
    out.write_text(json.dumps(res))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
