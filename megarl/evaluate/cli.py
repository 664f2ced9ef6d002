"""`megarl eval`: a model on eval sets, outside training.

    megarl eval --hf HF_DIR --data configs/eval/math500.yaml [--data ...] [--config C.yaml] [key=value ...]
    megarl eval --ckpt RUN/checkpoints/step_N/actor --data ...        (a megarl torch_dist checkpoint)
    megarl eval --nproc 8 ...      or      torchrun --nproc-per-node 8 -m megarl.cli eval ...

The model is an HF directory (`--hf`) or a megarl model checkpoint (`--ckpt`; its config and
tokenizer from `--hf`, else from the checkpoint's own hf/ folder), loaded into the rollout
engine of `rollout.engine` (builtin; sglang on GPUs, verified there only). Each rank generates
its share of the prompts (data parallel, the same sharding as the trainer's eval), the
trajectories are gathered, and rank 0 prints per set avg@n, pass@k, maj@n, mean score,
response length and truncation rate (megarl.evaluate.scores), then the line
``eval: accuracy=<mean avg@n over the sets> samples=<path>`` as its last line, and writes every
sample with its reward to <out>/samples.jsonl and the table to <out>/summary.json (<out>:
`--out`, default <trainer.run_dir>/eval).

Eval sets (`--data`, repeatable): a configs/eval/*.yaml file, a prompt dataset in any format
megarl.data reads (JSONL / parquet / a save_to_disk folder / hf:NAME?split=S; field keys from
data.*), or an inline override of data.eval. Sampling: the set's own settings, else eval.*;
`--n`, `--temperature`, `--top-p`, `--max-new-tokens` override both. The prompt template, the
reward routes (reward.sources) and the data keys come from the config: pass the run's
config.yaml (`--config RUN/config.yaml`) to evaluate as that run did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from megarl.config.cli import add_config_arguments, config_from_args
from megarl.evaluate.scores import SampleResult, summarize
from megarl.log import setup_logging


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl eval", description="evaluate a model on eval sets")
    p.add_argument("--hf", help="HF model directory (config, tokenizer; weights unless --ckpt)")
    p.add_argument("--ckpt", help="megarl model checkpoint (torch_dist) to evaluate instead of --hf's weights")
    p.add_argument("--data", action="append", default=[], required=True,
                   help="eval set: configs/eval/*.yaml, a dataset path, or hf:NAME?split=S (repeatable)")
    p.add_argument("--n", type=int, help="samples per prompt")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, help="nucleus threshold")
    p.add_argument("--max-new-tokens", type=int, help="generation cap")
    p.add_argument("--seed", type=int, help="sampling seed (default trainer.seed)")
    p.add_argument("--out", help="output folder for samples.jsonl and summary.json (default <trainer.run_dir>/eval)")
    p.add_argument("--nproc", type=int, default=0, help="spawn torchrun with this many local ranks")
    add_config_arguments(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.nproc and "RANK" not in os.environ:  # spawn torchrun, each rank runs this module without --nproc
        from megarl.parallel.launch import torchrun_command

        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
        return subprocess.call(torchrun_command(args.nproc, "megarl.evaluate.cli", without_nproc(argv)), env=env)
    setup_logging()
    from megarl.weights import CheckpointError

    try:
        hf, ckpt = model_paths(args)
    except (FileNotFoundError, CheckpointError) as e:
        print(f"megarl eval: {e}", file=sys.stderr)
        return 2
    from megarl.config import ConfigError

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    cfg.model.hf_path, cfg.model.load = hf, ckpt
    return evaluate(cfg, args)


def without_nproc(argv: list[str]) -> list[str]:
    """argv less --nproc N / --nproc=N (torchrun would read it as its own --nproc-per-node)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def model_paths(args) -> tuple[str, str | None]:
    """(HF directory, checkpoint or None) after checking they exist."""
    if not args.hf and not args.ckpt:
        raise FileNotFoundError("give --hf HF_DIR or --ckpt CHECKPOINT")
    if args.ckpt:
        from megarl.weights.dist_ckpt import read_checkpoint_meta

        read_checkpoint_meta(args.ckpt)  # CheckpointError naming the file when it is not one
        hf = args.hf or str(Path(args.ckpt) / "hf")
    else:
        hf = args.hf
    if not (Path(hf) / "config.json").is_file():
        raise FileNotFoundError(f"{hf} is not an HF model directory (no config.json)")
    return hf, args.ckpt


def evaluate(cfg, args) -> int:
    import torch.distributed as dist

    from megarl.parallel import exchange
    from megarl.parallel.distributed import destroy_distributed, init_distributed
    from megarl.rollout import SamplingParams
    from megarl.trainer import build
    from megarl.trainer.generation import RolloutWorker

    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    engine = load_engine(cfg, hf_config, tokenizer)
    images = build.image_inputs(cfg, hf_config, tokenizer)
    worker = RolloutWorker(engine, tokenizer, build.build_rewards(cfg), cfg,
                           ranks_per_engine=cfg.parallel.rollout_tp if cfg.rollout.engine == "sglang" else 1,
                           images=images)
    sets = build.build_eval_sets(cfg, [_spec(d) for d in args.data], tokenizer, images)
    rank0 = dist.get_rank() == 0
    summary, samples = {}, []
    for ev in sets:
        s = {"n_samples": cfg.eval.n_samples, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
             "max_new_tokens": cfg.eval.max_new_tokens, **ev.sampling}
        for key, flag in (("n_samples", args.n), ("temperature", args.temperature), ("top_p", args.top_p),
                          ("max_new_tokens", args.max_new_tokens)):
            s[key] = s[key] if flag is None else flag
        sampling = SamplingParams(n=s["n_samples"], temperature=s["temperature"], top_p=s["top_p"],
                                  max_new_tokens=s["max_new_tokens"],
                                  seed=cfg.trainer.seed if args.seed is None else args.seed)
        metas = worker.generate(ev.items, [list(it.prompt_ids) for it in ev.items], sampling, routing=False)
        mine = [m for m in metas if m.source == dist.get_rank()]
        parts = exchange.gather_objects([worker.store.get(m.key) for m in mine])  # rank order = the metas' order
        worker.store.drop(m.key for m in mine)
        if rank0:
            rows = sample_rows(ev, [t for p in parts for t in p], tokenizer)
            samples += rows
            summary[ev.name] = {**summarize([r.pop("_result") for r in rows]), "temperature": s["temperature"],
                                "top_p": s["top_p"], "max_new_tokens": float(s["max_new_tokens"])}
    if rank0:
        out = Path(args.out or Path(cfg.trainer.run_dir) / "eval")
        out.mkdir(parents=True, exist_ok=True)
        with (out / "samples.jsonl").open("w") as f:
            for row in samples:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print_table(summary)
        accuracy = sum(v[f"avg@{int(v['n'])}"] for v in summary.values()) / len(summary)
        print(f"eval: accuracy={accuracy:.4f} samples={out / 'samples.jsonl'}", flush=True)
    worker.rewards.close()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    destroy_distributed()
    return 0


def _spec(data: str):
    """A --data value as a data.eval entry (a YAML path, a dataset path, or an inline mapping)."""
    if data.lstrip().startswith("{"):
        import yaml

        return yaml.safe_load(data)
    return data


def load_engine(cfg, hf_config, tokenizer):
    """The rollout engine holding the model: --hf's weights, or the checkpoint's streamed in."""
    from megarl.trainer import build

    if cfg.rollout.engine == "sglang":
        from megarl.rollout.registry import make_engine
        from megarl.rollout.sglang.requests import server_args

        engine = make_engine("sglang", model_path=cfg.model.hf_path, group=build.engine_group(cfg.parallel.rollout_tp),
                             load_format="dummy" if cfg.model.load else "auto", **server_args(cfg))
        engine.start()
    else:
        engine = build.build_engine(cfg, hf_config, tokenizer)
        if not cfg.model.load:
            from megarl.weights.hf_reader import iter_checkpoint_buckets

            engine.update_weights(iter_checkpoint_buckets(cfg.model.hf_path))
    if cfg.model.load:
        from megarl.weights import stream_hf_weights

        actor = build.build_actor(cfg, hf_config, optim=False)
        engine.update_weights(stream_hf_weights(actor.modules, hf_config, cfg.rollout.weight_bucket_mb << 20))
        del actor
    return engine


def sample_rows(ev, trajs, tokenizer) -> list[dict]:
    """One JSON row per sample (with its SampleResult under "_result" for the summary)."""
    from megarl.rewards.math_answer import extract_answer, normalize

    items = {it.uid: it for it in ev.items}
    rows, seen = [], {}
    for t in trajs:
        text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
        pred = extract_answer(text)
        k = seen[t.uid] = seen.get(t.uid, -1) + 1
        rows.append({"set": ev.name, "uid": t.uid, "sample": k, "prompt": items[t.uid].prompt, "response": text,
                     "gold": items[t.uid].answer, "pred": pred, "score": t.score, "acc": bool(t.acc),
                     "finish_reason": t.finish_reason, "response_tokens": len(t.response_ids),
                     "_result": SampleResult(t.uid, bool(t.acc), float(t.score),
                                             normalize(pred) if pred is not None else None, len(t.response_ids),
                                             t.finish_reason == "length")})
    return rows


def print_table(summary: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="megarl eval")
    for col in ("set", "prompts", "n", "avg@n", "pass@1", "pass@n", "maj@n", "score", "length", "truncated"):
        t.add_column(col, justify="left" if col == "set" else "right")
    for name, v in summary.items():
        n = int(v["n"])
        t.add_row(name, str(int(v["prompts"])), str(n), f"{v[f'avg@{n}']:.4f}", f"{v['pass@1']:.4f}",
                  f"{v[f'pass@{n}']:.4f}", f"{v[f'maj@{n}']:.4f}", f"{v['score']:.3f}", f"{v['response_length']:.1f}",
                  f"{v['truncated']:.3f}")
    Console(width=None if sys.stdout.isatty() else 120).print(t)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
