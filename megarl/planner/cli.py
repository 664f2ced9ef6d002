"""`megarl plan` (and `python -m tools.plan`): plan a recipe + layout on a GPU, print the memory
and time figures; exit 1 when the layout does not fit, 2 on a config error."""

from __future__ import annotations

import argparse
import os
import sys

from megarl.config import ConfigError, MegaRLConfig, load_config
from megarl.planner.arch import GIB, GPUS, MOE_IMBALANCE, load_arch
from megarl.planner.memory import Plan, plan
from megarl.planner.vision import DEFAULT_IMAGE_PIXELS, image_load

def format_plan(cfg: MegaRLConfig, pl: Plan, arch_src: str) -> str:
    p = cfg.parallel
    g = lambda b: f"{b / GIB:7.1f} GiB"  # noqa: E731
    v, im, rd = pl.arch.vision, pl.images, pl.rollout_data
    lines = [
        f"model {cfg.model.name or cfg.model.hf_path} ({pl.params_total / 1e9:.2f}B params"
        + (f": {pl.arch.lm_params() / 1e9:.2f}B LM + {v.total_params() / 1e9:.2f}B vision tower" if v else "")
        + (f", {pl.arch.active_params() / 1e9:.2f}B active: {pl.arch.num_experts} experts, top-{pl.arch.moe_topk}"
           if pl.arch.num_experts else "") + f", from {arch_src})",
        f"layout: {p.nodes} nodes x {p.gpus_per_node} {pl.gpu.name} = {pl.world} GPUs; tp={p.tp} pp={p.pp} cp={p.cp} "
        f"dp={pl.dp} vpp={p.vpp} sp={cfg.model.sequence_parallel} recompute={cfg.model.recompute} rollout_tp={p.rollout_tp}"
        + (f" (attention dp {cfg.rollout.sglang_dp_size}, engine ep {cfg.rollout.sglang_ep_size})"
           if cfg.rollout.sglang_dp_size > 1 or cfg.rollout.sglang_ep_size > 1 else "")
        + f" rollout weights {cfg.rollout.weights_dtype}"
        + (f" ep={p.ep} etp={p.etp or p.tp} edp={max(1, pl.world // ((p.etp or p.tp) * p.ep * p.pp))}"
           if pl.arch.num_experts else ""),
    ]
    if v and im:
        lines.append(f"images: {im.per_sample} per sample x {im.tokens} tokens ({im.patches} tower patches); "
                     f"vision tower {v.depth} blocks x {v.hidden} wide on the first stage, "
                     f"{pl.arch.stage_vision_params(p.tp) / 1e9:.2f}B params/GPU"
                     + (" (frozen)" if getattr(cfg.model, "freeze_vision", False) else ""))
    lines += [
        "",
        "per-GPU memory",
    ]
    for s in pl.states:
        experts = pl.arch.stage_expert_params(p.pp, p.ep, p.etp or p.tp)
        lines.append(f"  {s.role:<9} params/GPU {s.params_gpu / 1e9:6.2f}B"
                     + (f" ({experts / 1e9:.2f}B routed experts)" if experts else "") + f"  weights {g(s.weights)}  grads {g(s.grads)}  "
                     f"optimizer {g(s.optimizer)}{' (offloaded)' if s.offload_optimizer else ''}")
    for role, a in pl.activations.items():
        budget = getattr(cfg, role).max_tokens_per_microbatch
        kv_mib = a["kv_exchange"] / 2**20
        moe = f", MoE dispatcher + grouped GEMM buffers {g(a['moe_buffers'])}" if pl.arch.num_experts else ""
        vis = (f", vision tower {g(a['vision'])} for {a['patches'] // im.patches} images = {a['patches']:,} patches"
               if v and im else "")
        lines.append(f"  {role:<9} activations {g(a['total'])} (layers {g(a['layers'])}, CP K/V {kv_mib:,.0f} MiB, "
                     f"attention workspace {g(a['workspace'])}, logits {g(a['logits'])}{moe}{vis}) at {budget} "
                     f"tokens/micro-batch = {budget // p.cp} per GPU")
    lines += [
        f"  engine    share {g(pl.engine_share)} (weights {g(pl.engine_weights)}, KV pool {g(max(pl.kv_pool, 0))} "
        f"= {pl.kv_tokens:,.0f} tokens)",
        f"  reserve   {g(pl.reserve)}",
        f"  rollout phase peak {g(pl.rollout_peak)}   weight sync peak {g(pl.sync_peak)} (stream buffers "
        f"{g(pl.sync_stream)})   train phase peak {g(pl.train_peak)}   capacity {g(pl.gpu.mem_bytes)}",
        f"  rollout data per rank: receives {g(rd['received'])} of payloads ({rd['rows_per_rank']:,.0f} rows) + "
        f"{g(rd['meta'])} of metadata; host peak {g(rd['host_peak'])} (own rows {g(rd['generated'])}); "
        f"GPU {rd['gpu'] / 2**20:,.1f} MiB (one micro-batch)",
        "",
        f"step time (assumed mean prompt {pl.time['avg_prompt_len']}"
        + (f" incl. {im.sample_tokens} image tokens" if v and im else "")
        + f" / response {pl.time['avg_response_len']} tokens, MFU {pl.time['mfu']:.2f})",
        f"  rollout {pl.time['rollout_s'] / 60:6.1f} min  ({pl.time['decode_steps']:,} decode steps x "
        f"{pl.time['decode_step_s'] * 1e3:.1f} ms of which {pl.time['decode_comm_s'] * 1e3:.1f} ms communication, "
        f"{pl.time['concurrent_seqs_per_engine']} of "
        f"{pl.time['seqs_per_engine']} sequences concurrent per engine)",
        f"  train   {pl.time['train_s'] / 60:6.1f} min  ({pl.time['train_flops']:.3g} FLOPs over {pl.time['train_tokens']:,} tokens)",
        f"  host    {pl.time['host_s'] / 60:6.1f} min  (copies of offloaded state over PCIe)",
        f"  step    {pl.time['step_s'] / 60:6.1f} min",
        "",
        "FITS" if pl.fits else "DOES NOT FIT:\n  " + "\n  ".join(pl.problems),
    ]
    return "\n".join(lines)


def shipped(configs: str = "configs") -> list[tuple[str, str]]:
    """(recipe, layout) of every shipped layout with every recipe of its model."""
    import glob

    out = []
    for layout in sorted(glob.glob(os.path.join(configs, "layouts", "*", "*node*.yaml"))):
        model = os.path.basename(os.path.dirname(layout))
        out += [(recipe, layout) for recipe in sorted(glob.glob(os.path.join(configs, "recipes", model, "*.yaml")))]
    return out


def plan_table(gpus: list[str], configs: str = "configs") -> str:
    """A markdown table of every shipped recipe x layout x GPU: the three phase peaks, the step
    time, the rollout data per rank, and what does not fit."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    rows = ["| recipe + layout | GPU | rollout / sync / train peak (GiB) | step | rollout data per rank: received, "
            "host peak | fits |", "| --- | --- | --- | --- | --- | --- |"]
    for recipe, layout in shipped(configs):
        cfg = load_config([recipe, layout])
        arch, hf, _ = load_arch(cfg)
        for gpu in gpus:
            pl = plan(cfg, arch, hf, GPUS[gpu])
            rd = pl.rollout_data
            name = f"`{os.path.relpath(layout, os.path.join(configs, 'layouts')).removesuffix('.yaml')}` + " \
                   f"`{os.path.basename(recipe).removesuffix('.yaml')}`"
            why = "yes" if pl.fits else "no: " + "; ".join(p.split(";")[0] for p in pl.problems)
            rows.append(f"| {name} | {gpu} | {g(pl.rollout_peak)} / {g(pl.sync_peak)} / {g(pl.train_peak)} | "
                        f"{pl.time['step_s'] / 60:.0f} min | {g(rd['received'])} GiB, {g(rd['host_peak'])} GiB | {why} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megarl plan", description="Plan a megarl run: per-GPU memory in the rollout and train phases, and a step-time estimate.")
    ap.add_argument("--table", action="store_true",
                    help="print a markdown table of every shipped recipe x layout on --gpu (h100,h200 with 'all')")
    ap.add_argument("--recipe", help="recipe YAML (required unless --table)")
    ap.add_argument("--layout", action="append", default=[], help="layout YAML composed after the recipe")
    ap.add_argument("--nodes", type=int, help="override parallel.nodes")
    ap.add_argument("--gpu", choices=sorted(GPUS) + ["all"], default="h100")
    ap.add_argument("--model-json", help="HF config.json of the model (default: hf_path or configs/models/<name>.json)")
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="per-GPU reserve for contexts, NCCL, fragmentation")
    ap.add_argument("--mfu", type=float, default=0.4, help="training model-FLOPs utilisation")
    ap.add_argument("--decode-eff", type=float, default=0.6, help="achieved fraction of HBM bandwidth / peak during decode")
    ap.add_argument("--avg-prompt-len", type=int, help="mean prompt tokens (default min(256, max_prompt_len))")
    ap.add_argument("--avg-response-len", type=int, help="mean response tokens (default max_new_tokens / 2)")
    ap.add_argument("--gen-rounds", type=int, default=1, help="dynamic-sampling generation rounds per step")
    ap.add_argument("--moe-imbalance", type=float, default=MOE_IMBALANCE,
                    help="MoE: routed tokens on the busiest EP rank over the mean (1 = perfectly balanced)")
    ap.add_argument("--images-per-sample", type=int, default=1, help="vision-language models: images per prompt")
    ap.add_argument("--image-pixels", type=int, default=DEFAULT_IMAGE_PIXELS,
                    help="vision-language models: pixels of each (square) image after the processor's resize")
    ap.add_argument("--image-tokens", type=int,
                    help="vision-language models: LM tokens per image (overrides --image-pixels)")
    ap.add_argument("--images-per-microbatch", type=int,
                    help="vision-language models: images in one training micro-batch (default: the samples a "
                         "micro-batch holds at the mean sample length x --images-per-sample)")
    ap.add_argument("--search", action="store_true",
                    help="search the layouts of --recipe on --nodes (from --layout) and print the best --top "
                         "by planned step (megarl/planner/search.py)")
    ap.add_argument("--top", type=int, default=5, help="--search: layouts to print")
    ap.add_argument("--fit-also", action="append", default=[], metavar="RECIPE",
                    help="--search: the layout must fit this recipe too (e.g. the model's VAPO recipe)")
    ap.add_argument("--max-engine-nodes", type=int, default=4, help="--search: the largest engine, in nodes")
    ap.add_argument("--weights-dtypes", default="bf16,fp8",
                    help="--search: rollout.weights_dtype values to try (comma-separated)")
    ap.add_argument("--write", metavar="LAYOUT_YAML", help="--search: write the best layout to this file")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    return ap


def run_search(args: argparse.Namespace, overrides: list[str]) -> int:
    """`megarl plan --search`: the best layouts (megarl.planner.search), and with --write the best
    one as a layout file, checked by loading it with every recipe."""
    import shlex

    import yaml

    from megarl.planner.search import format_search, layout_yaml, search

    recipes = [args.recipe, *args.fit_also]
    try:
        cfgs = [load_config([r, *args.layout], overrides) for r in recipes]
        arch, hf, _ = load_arch(cfgs[0], args.model_json)
        dtypes = tuple(d.strip() for d in args.weights_dtypes.split(",") if d.strip())
        if not dtypes or set(dtypes) - {"bf16", "fp8"}:
            raise ConfigError(f"--weights-dtypes: bf16 and/or fp8, got {args.weights_dtypes!r}")
        found = search(cfgs, arch, hf, GPUS[args.gpu], top=args.top, max_engine_nodes=args.max_engine_nodes,
                       weights_dtypes=dtypes,
                       reserve_gib=args.reserve_gib, avg_prompt_len=args.avg_prompt_len,
                       avg_response_len=args.avg_response_len, mfu=args.mfu, decode_eff=args.decode_eff,
                       gen_rounds=args.gen_rounds, moe_imbalance=args.moe_imbalance)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_search(found, [os.path.relpath(r) for r in recipes]))
    if not found:
        return 1
    if args.write:
        base: dict = {}
        for path in args.layout:
            with open(path, encoding="utf-8") as f:
                base.update(yaml.safe_load(f) or {})
        argv = ["megarl", "plan", "--search", "--recipe", args.recipe, *sum((["--fit-also", r] for r in args.fit_also), []),
                *sum((["--layout", lay] for lay in args.layout), []), "--gpu", args.gpu,
                *(["--nodes", str(args.nodes)] if args.nodes else []),
                *(["--weights-dtypes", args.weights_dtypes] if args.weights_dtypes != "bf16,fp8" else []),
                "--write", args.write, *args.overrides]
        text = layout_yaml(found[0], base, [os.path.relpath(r) for r in recipes], shlex.join(argv), GPUS[args.gpu].name)
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
        for r in recipes:  # the file must load with every recipe it was chosen for
            load_config([r, args.write], args.overrides)
        print(f"wrote {args.write}")
    return 0


def main(argv: list[str] | None = None) -> int:  # noqa: D103
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.table:
        print(plan_table(sorted(GPUS) if args.gpu == "all" else [args.gpu]))
        return 0
    if not args.recipe:
        ap.error("--recipe is required (or --table)")
    if args.gpu == "all":
        ap.error("--gpu all goes with --table")
    overrides = list(args.overrides) + ([f"parallel.nodes={args.nodes}"] if args.nodes else [])
    if args.search:
        return run_search(args, overrides)
    if args.write:
        ap.error("--write goes with --search")
    try:
        cfg = load_config([args.recipe, *args.layout], overrides)
        arch, hf, src = load_arch(cfg, args.model_json)
        images = image_load(arch, args.images_per_sample, args.image_pixels, args.image_tokens, args.images_per_microbatch)
        pl = plan(cfg, arch, hf, GPUS[args.gpu], args.reserve_gib, args.avg_prompt_len, args.avg_response_len,
                  args.mfu, args.decode_eff, args.gen_rounds, args.moe_imbalance, images)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_plan(cfg, pl, os.path.relpath(src, os.getcwd())))
    return 0 if pl.fits else 1


if __name__ == "__main__":
    sys.exit(main())
