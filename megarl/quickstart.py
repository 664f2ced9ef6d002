"""The CPU quickstart: tiny model -> SFT warm start -> Megatron -> RL (DAPO) -> table.

`megarl quickstart [--nproc 2] [--config configs/quickstart.yaml] [key=value ...]` spawns
torchrun with gloo ranks running `python -m megarl.quickstart`, which:

1. builds a tiny model (`quickstart.family`: dense Qwen2, Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 /
   GLM-4.5 with `quickstart.num_experts` experts, top `quickstart.moe_topk`, or the vision-language Qwen2.5-VL
   / Qwen3-VL-MoE with its image processor) + byte tokenizer from scratch and writes the task `quickstart.task`
   (default: synthetic arithmetic, a chain of thought ending in `Answer: <n>`),
2. converts the HF model to a Megatron torch_dist checkpoint at the configured TP/PP/EP,
3. warm-starts it with SFT (deliberately short, so there is room to learn; a finished SFT of the
   same run dir with the same sft.* settings is reused),
4. evaluates (accuracy on held-out problems, greedy in most presets), runs RL, evaluates again,
5. prints a table, where `megarl report` wrote the run's curves (report: png=... html=...) and,
   as its last line:
   quickstart: accuracy_before=<float> accuracy_after=<float> wall_s=<float> run_dir=<path>

Resumable: every step's output appears only complete (the tiny model, task files and Megatron
conversion are written to `<name>.partial` and renamed; the SFT checkpoint counts once
`sft_done.json` is written), so re-running the same command skips finished steps and redoes an
interrupted one. With `trainer.resume=true` the RL continues from the newest complete
checkpoint (configs/quickstart/base.yaml saves every 10 steps), and the final line is the same
as an uninterrupted run's (wall_s aside): accuracy_before comes from the step-0 evaluation the
first attempt logged to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megarl.config import MegaRLConfig
from megarl.log import setup_logging
from megarl.parallel.launch import torchrun_command

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart" / "dapo.yaml"


def launch(argv: list[str]) -> int:
    """Spawns the quickstart under torchrun (gloo) and relays its output, once the config loads and
    its loggers can start (package, network): a bad config or a missing logger package is one line
    on stderr and exit status 2, before any rank starts."""
    from megarl.config import ConfigError, load_config
    from megarl.trainer.loggers import LoggerError, check_loggers

    p = argparse.ArgumentParser(prog="megarl quickstart")
    p.add_argument("--nproc", type=int, default=2, help="number of ranks (TP=2 by default)")
    p.add_argument("--config", action="append", default=[], help="config files (default configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    a = p.parse_args(argv)
    configs = a.config or [str(DEFAULT_CONFIG)]
    try:
        check_loggers(load_config(configs, a.overrides))
    except (ConfigError, LoggerError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    argv = [arg for c in configs for arg in ("--config", c)] + a.overrides
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    return subprocess.call(torchrun_command(a.nproc, "megarl.quickstart", argv), env=env)


def worker(argv: list[str]) -> None:
    import torch.distributed as dist

    from megarl.config import save_config
    from megarl.config.cli import add_config_arguments, config_from_args
    from megarl.parallel.distributed import destroy_distributed, init_distributed, phase
    from megarl.tasks import quickstart_task

    t0 = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m megarl.quickstart")
    add_config_arguments(p)
    cfg = config_from_args(p.parse_args(argv))
    setup_logging()
    run = Path(cfg.trainer.run_dir).resolve()
    cfg.trainer.run_dir = str(run)
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    rank0 = dist.get_rank() == 0
    task = quickstart_task(cfg.quickstart.task)

    # 1. tiny model, tokenizer and task data (rank 0 writes, everyone waits)
    model_dir, task_dir = run / "tiny_model", run / "task"
    if rank0:
        run.mkdir(parents=True, exist_ok=True)
        save_config(cfg, str(run / "config.yaml"))
        with phase("build"):
            _write_once(model_dir, lambda tmp: save_quickstart_model(tmp, cfg))
            _write_once(task_dir, lambda tmp: task.write_files(tmp, cfg))
    dist.barrier()
    _check_built_model(model_dir, cfg)
    cfg.model.hf_path = str(model_dir)
    cfg.sft.data_path = str(task_dir / "sft.jsonl")
    cfg.data.train_path = str(task_dir / "train.jsonl")
    cfg.data.eval = [{"path": str(task_dir / "eval.jsonl"), "name": cfg.quickstart.task}]

    # 2. HF -> Megatron (torch_dist at this TP/PP), 3. SFT warm start
    from megarl.trainer.sft import sft

    mcore_dir = run / "megatron_init"
    if not (mcore_dir / "megarl_model.json").exists():
        with phase("convert"):
            partial = mcore_dir.with_name(mcore_dir.name + ".partial")
            if rank0:
                shutil.rmtree(partial, ignore_errors=True)
            dist.barrier()
            _hf_to_megatron(model_dir, partial, cfg.model.dtype)
            if rank0:
                os.replace(partial, mcore_dir)
            dist.barrier()
    cfg.model.load = str(mcore_dir)
    t_sft = time.perf_counter()
    sft_out = _finished_sft(run / "sft_actor", cfg)
    if sft_out is None:
        with phase("sft"):
            if rank0:  # an interrupted attempt's checkpoint and log
                shutil.rmtree(run / "sft_actor", ignore_errors=True)
                shutil.rmtree(run / "sft", ignore_errors=True)
            dist.barrier()
            sft_out = sft(cfg, save_to=str(run / "sft_actor"))
            if rank0:
                tmp = run / "sft_actor" / f".{SFT_DONE}.tmp"
                tmp.write_text(json.dumps({**sft_out, "sft": _sft_settings(cfg)}))
                os.replace(tmp, run / "sft_actor" / SFT_DONE)
            dist.barrier()
    t_sft = time.perf_counter() - t_sft

    if cfg.quickstart.critic_sft_steps:  # the critic's initial backbone: the policy SFT continued
        with phase("sft"):
            cfg.critic.init_from = _critic_sft(run, cfg, sft_out)

    # 4. RL from the SFT checkpoint, evaluating before and after
    from megarl.trainer.loop import train

    cfg.model.load = sft_out["checkpoint"]
    cfg.trainer.val_before_train = True
    if task.before_rl is not None:
        with phase("before_rl"):
            task.before_rl(cfg, run, sft_out)
    t_rl = time.perf_counter()
    with phase("rl"):
        result = train(cfg)
    t_rl = time.perf_counter() - t_rl
    compare = _comparison(cfg, run, task) if task.comparison is not None else None  # e.g. the same RL without tools
    # a resumed run did not evaluate before training (nor after, resumed at the last step)
    before = result["first_eval"].get("eval/accuracy", _logged_eval(run, 0))
    after = result["last_eval"].get("eval/accuracy", _logged_eval(run, cfg.trainer.total_steps))
    wall = time.perf_counter() - t0
    if rank0:
        extra = [(k, result["first_eval"].get(k, _logged_eval(run, 0, k)),
                  result["last_eval"].get(k, _logged_eval(run, cfg.trainer.total_steps, k))) for k in task.table_metrics]
        _print_table(cfg, sft_out, before, after, t_sft, t_rl, wall, extra, compare)
        _report(run)
        if compare is not None:
            print(f"quickstart comparison ({compare['label']}): accuracy_before={compare['before']:.4f} "
                  f"accuracy_after={compare['after']:.4f} wall_s={compare['wall']:.1f}", flush=True)
        print(f"quickstart: accuracy_before={before:.4f} accuracy_after={after:.4f} "
              f"wall_s={wall:.1f} run_dir={run}", flush=True)
    destroy_distributed()


SFT_DONE = "sft_done.json"  # written after the SFT checkpoint is complete


def _report(run: Path) -> None:
    """The run's curves (megarl report) next to its metrics; where they are, or why not."""
    from megarl.report import write_report

    try:
        png, page = write_report(run)
        print(f"report: png={png} html={page}", flush=True)
    except Exception as e:  # a plot is no reason to lose the result line (e.g. trainer.loggers without jsonl)
        print(f"report: not written ({type(e).__name__}: {e})", flush=True)


def _critic_sft(run: Path, cfg: MegaRLConfig, sft_out: dict) -> str:
    """quickstart.critic_sft_steps more SFT steps from the policy's SFT checkpoint, saved to
    <run>/sft_critic (reused when complete with the same settings); returns the checkpoint."""
    import torch.distributed as dist

    from megarl.trainer.sft import sft

    path, steps = run / "sft_critic", cfg.quickstart.critic_sft_steps
    settings = {**_sft_settings(cfg), "from": sft_out["checkpoint"], "critic_sft_steps": steps}
    done = path / SFT_DONE
    if done.exists() and json.loads(done.read_text()).get("sft") == settings:
        return json.loads(done.read_text())["checkpoint"]
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    scfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, load=sft_out["checkpoint"]),
                               trainer=dataclasses.replace(cfg.trainer, run_dir=str(run / "sft_critic_log")))
    out = sft(scfg, max_steps=steps, save_to=str(path))
    if dist.get_rank() == 0:
        tmp = path / f".{SFT_DONE}.tmp"
        tmp.write_text(json.dumps({**out, "sft": settings}))
        os.replace(tmp, done)
    dist.barrier()
    return out["checkpoint"]


def save_quickstart_model(out: Path, cfg: MegaRLConfig) -> None:
    """The tiny model of `quickstart.family` (tokenizer, weights; a VLM also its image processor)."""
    if cfg.quickstart.family == "qwen2_5_vl":
        from megarl.tasks.tiny_vlm import save_tiny_vlm

        save_tiny_vlm(out, seed=cfg.trainer.seed)
        return
    if cfg.quickstart.family in ("qwen3_vl_moe", "qwen3_5_moe"):
        from megarl.tasks.tiny_qwen3_vl import TinyQwen3VLSpec, save_tiny_qwen3_vl

        q = cfg.quickstart
        save_tiny_qwen3_vl(out, TinyQwen3VLSpec(num_experts=q.num_experts, moe_topk=q.moe_topk,
                                                moe_intermediate=q.moe_intermediate, hybrid=q.family == "qwen3_5_moe"),
                           seed=cfg.trainer.seed)
        return
    from megarl.tasks.tiny_model import save_tiny_model

    save_tiny_model(out, tiny_model_spec(cfg))


def tiny_model_spec(cfg: MegaRLConfig):
    """The tiny model of this quickstart: the default sizes, `quickstart.*` picks the family."""
    from megarl.tasks.tiny_model import TinyModelSpec

    q = cfg.quickstart
    moe = q.family != "qwen2"
    return TinyModelSpec(seed=cfg.trainer.seed, family=q.family, num_experts=q.num_experts if moe else 0,
                         moe_topk=q.moe_topk if moe else 0, moe_intermediate=q.moe_intermediate if moe else 0)


def _check_built_model(model_dir: Path, cfg: MegaRLConfig) -> None:
    """A run dir keeps the tiny model it was first built with: refuse quickstart.* settings that
    describe another one (e.g. the MoE config pointed at a dense run dir)."""
    from transformers import AutoConfig

    built = AutoConfig.from_pretrained(model_dir)
    vlm = ("qwen2_5_vl", "qwen3_vl_moe", "qwen3_5_moe")  # vision-language families: the model type is the whole check
    if (built.model_type in vlm or cfg.quickstart.family in vlm) and built.model_type != cfg.quickstart.family:
        raise SystemExit(f"quickstart: {model_dir} holds a tiny {built.model_type} model, but quickstart.family is "
                         f"{cfg.quickstart.family!r}; use another trainer.run_dir")
    if built.model_type in vlm:
        return
    spec = tiny_model_spec(cfg)
    want = {"model_type": spec.family, "num_experts": spec.num_experts or None,
            "num_experts_per_tok": spec.moe_topk or None, "moe_intermediate_size": spec.moe_intermediate or None}
    have = {k: getattr(built, k, None) for k in want}
    have["num_experts"] = have["num_experts"] or getattr(built, "n_routed_experts", None)  # deepseek_v3, glm4_moe
    if have != want:
        raise SystemExit(f"quickstart: {model_dir} holds a tiny model with {have}, but quickstart.* asks for {want}; "
                         "use another trainer.run_dir")


def _write_once(path: Path, write) -> None:
    """`write(tmp)` into `<path>.partial`, renamed to `path` when done; nothing if `path` exists."""
    if path.exists():
        return
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    os.replace(partial, path)


def _logged_eval(run: Path, step: int, key: str = "eval/accuracy") -> float:
    """The last `key` logged for `step` in run/metrics.jsonl (nan if none)."""
    value = float("nan")
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short
            continue
        if row.get("step") == step and row.get(key) is not None:
            value = float(row[key])
    return value


def _finished_sft(path: Path, cfg: MegaRLConfig) -> dict | None:
    """The SFT result of an earlier run of this quickstart with the same SFT settings, if its
    checkpoint is complete (re-running a run dir, or one seeded with another run's tiny_model/,
    task/, megatron_init/ and sft_actor/, skips the SFT phase)."""
    done = path / SFT_DONE
    if not done.exists():
        return None
    out = json.loads(done.read_text())
    return out if out.pop("sft", None) == _sft_settings(cfg) else None


def _sft_settings(cfg: MegaRLConfig) -> dict:
    """sft.* without the data path (always <run_dir>/task/sft.jsonl here)."""
    return {k: v for k, v in dataclasses.asdict(cfg.sft).items() if k != "data_path"}


def _hf_to_megatron(hf_dir: Path, out: Path, dtype: str) -> None:
    """The conversion tool's hf-to-megatron step, in-process at the current TP/PP."""
    from transformers import AutoConfig

    from megarl.models import build_model
    from megarl.weights import load_hf_weights, save_megatron_checkpoint

    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = build_model(hf_config, dtype=dtype)
    load_hf_weights(model, hf_dir)
    save_megatron_checkpoint(model, out, hf_config, hf_source_dir=hf_dir)


def _comparison(cfg: MegaRLConfig, run: Path, task) -> dict:
    """task.comparison: the same RL from the same SFT checkpoint with the task's overrides, its run
    dir <run>/<label> (resumed like the first with trainer.resume); its accuracy before and after
    RL, its wall time and its table metrics after RL."""
    from megarl.config import config_to_dict, from_dict
    from megarl.config.loader import apply_override
    from megarl.parallel.distributed import phase
    from megarl.trainer.loop import train

    label, overrides = task.comparison
    tree = config_to_dict(cfg)
    for text in (*overrides, f"trainer.run_dir={run / label}"):
        apply_override(tree, {}, text)
    ccfg = from_dict(tree)
    t = time.perf_counter()
    with phase("rl"):
        result = train(ccfg)
    crun, steps = run / label, ccfg.trainer.total_steps
    return {"label": label, "steps": steps, "wall": time.perf_counter() - t, "algorithm": ccfg.algorithm.name,
            "before": result["first_eval"].get("eval/accuracy", _logged_eval(crun, 0)),
            "after": result["last_eval"].get("eval/accuracy", _logged_eval(crun, steps)),
            "extra": {k: result["last_eval"].get(k, _logged_eval(crun, steps, k)) for k in task.table_metrics}}


def _print_table(cfg: MegaRLConfig, sft_out, before, after, t_sft, t_rl, wall, extra=(), compare=None) -> None:
    from rich.console import Console
    from rich.table import Table

    q, p = cfg.quickstart, cfg.parallel
    model = q.family if q.family in ("qwen2", "qwen2_5_vl") else f"{q.family} {q.num_experts} experts top-{q.moe_topk}"
    t = Table(title=f"megarl quickstart ({cfg.algorithm.name}, {model}, TP={p.tp} EP={p.ep})")
    t.add_column("phase")
    t.add_column("steps", justify="right")
    t.add_column("wall s", justify="right")
    e = cfg.eval
    how = "greedy" if e.temperature == 0 else f"T={e.temperature:g}, {e.n_samples} samples"
    t.add_column(f"eval accuracy ({how})", justify="right")
    t.add_row("SFT warm start", str(sft_out["steps"]), f"{t_sft:.1f}", f"{before:.3f}")
    t.add_row(f"RL ({cfg.algorithm.name})", str(cfg.trainer.total_steps), f"{t_rl:.1f}", f"{after:.3f}")
    if compare is not None:  # the task's comparison run from the same SFT checkpoint
        t.add_row(f"RL ({compare['algorithm']}, {compare['label']}; before {compare['before']:.3f})",
                  str(compare["steps"]), f"{compare['wall']:.1f}", f"{compare['after']:.3f}")
    t.add_row("total", "", f"{wall:.1f}", f"{after - before:+.3f}")
    Console().print(t)
    if extra:  # the task's own eval metrics (its mechanism), before -> after RL
        m = Table(title=f"task {cfg.quickstart.task}: eval metrics before -> after RL")
        cols = ("metric", "before RL", "after RL") + ((f"after RL ({compare['label']})",) if compare else ())
        for col in cols:
            m.add_column(col, justify="left" if col == "metric" else "right")
        for key, b, a in extra:
            c = compare["extra"].get(key, float("nan")) if compare else None
            m.add_row(key, f"{b:.3f}", f"{a:.3f}", *([f"{c:.3f}" if c == c else "-"] if compare else []))  # nan: not logged
        Console().print(m)


if __name__ == "__main__":
    worker(sys.argv[1:])
