"""Make the quickstart's tiny Qwen2 model (random init) and, optionally, its arithmetic task data.

    .venv/bin/python -m tools.make_tiny_model --out runs/tiny-qwen2 \
        [--layers 3 --hidden 128 --heads 4 --kv-heads 2 --intermediate 384 --seed 0] \
        [--task-dir runs/arith --digits 3 --n-sft 20000 --n-train 5000 --n-eval 500]

Writes config.json, model.safetensors, generation_config.json and the byte-level tokenizer
(`megarl.tasks.tiny_model`); `AutoTokenizer/AutoModelForCausalLM.from_pretrained(out)` load it
offline. With --task-dir also writes sft.jsonl / train.jsonl / eval.jsonl (`megarl.tasks.arith`).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.make_tiny_model`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import argparse


from megarl.tasks.arith import write_task_files  # noqa: E402
from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model  # noqa: E402
from tools._options import add_options


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="model output directory")
    add_options(p, layers=3, hidden=128, heads=4, kv_heads=2, intermediate=384, max_position_embeddings=256)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--vocab-multiple", type=int, default=64, help="round vocab_size up to a multiple of this")
    p.add_argument("--seed", type=int, default=0, help="model init seed and task data seed")
    p.add_argument("--task-dir", default=None, help="also write the arithmetic task files here")
    add_options(p, digits=3, n_sft=20000, n_train=5000, n_eval=500)
    a = p.parse_args(argv)
    spec = TinyModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                         intermediate=a.intermediate, max_position_embeddings=a.max_position_embeddings,
                         tie_word_embeddings=a.tie_word_embeddings, rope_theta=a.rope_theta,
                         vocab_multiple=a.vocab_multiple, seed=a.seed)
    out = save_tiny_model(a.out, spec)
    print(f"model + tokenizer -> {out}")
    if a.task_dir:
        paths = write_task_files(a.task_dir, a.n_sft, a.n_train, a.n_eval, a.seed, digits=a.digits)
        print("task files -> " + ", ".join(str(v) for v in paths.values()))


if __name__ == "__main__":
    main()
