"""Pre-PPO prompt selection (docs/algorithms.md §7): score candidate prompts with the policy's own
samples and the reward routes, keep the hardest after per-domain normalisation.

    python -m tools.select_prompts --hf MODEL_DIR --candidates new.jsonl --out selected.jsonl \
        [--config RECIPE.yaml ...] [--samples 8] [--fraction 0.1] [--merge-with train.jsonl] \
        [--batch-prompts 32] [key=value ...]

The recipe's config supplies what training would use: data.* (prompt/answer/source keys,
template, max_prompt_len), reward.* (hybrid routing: rule-based verifiers, GenRM for the rest)
and rollout.temperature / top_p / max_new_tokens. Each candidate gets --samples responses from
the builtin engine on MODEL_DIR (an HF directory, e.g. the SFT policy exported with
tools/convert_checkpoint.py megatron-to-hf); its score is their mean reward, normalised within
its data source, and the lowest --fraction are written to --out (JSONL, original fields plus
`id`, `pre_ppo_score`, `pre_ppo_z`; file order). With --merge-with, --out holds that file's
rows first, then the selected ones (the paper merges the selected prompts into the original
set). Bad rows and over-long prompts are skipped and counted as in training. A summary per
data source (candidates, kept, mean score of all vs kept) is printed and written to
<out>.summary.json.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.select_prompts`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import sys
from pathlib import Path



def parse_args(argv=None):
    from megarl.config.cli import add_config_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF model directory of the policy that samples")
    p.add_argument("--candidates", required=True, help="candidate prompts (.jsonl/.json/.parquet or a directory)")
    p.add_argument("--out", required=True, help="selected prompts, JSONL")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (not stated in the paper)")
    p.add_argument("--fraction", type=float, default=0.1, help="share of candidates kept (paper: ~10%%)")
    p.add_argument("--merge-with", help="original training set (JSONL) written before the selected rows")
    p.add_argument("--batch-prompts", type=int, default=32, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    add_config_arguments(p)
    a = p.parse_args(argv)
    if a.samples < 1 or not 0 < a.fraction <= 1 or a.batch_prompts < 1:
        p.error("--samples and --batch-prompts must be >= 1 and --fraction in (0, 1]")
    return a


def score_candidates(engine, rewards, items, sampling, batch_prompts: int) -> list[list[float]]:
    """Reward of each of `sampling.n` responses per item (items carry prompt_ids)."""
    from megarl.rewards import RewardInput

    scores: list[list[float]] = [[] for _ in items]
    for start in range(0, len(items), batch_prompts):
        chunk = items[start:start + batch_prompts]
        samples = engine.generate([it.prompt_ids for it in chunk], sampling)
        inputs = [RewardInput(data_source=chunk[s.index].data_source, prompt=chunk[s.index].prompt,
                              response=s.text or engine.tokenizer.decode(s.response_ids, skip_special_tokens=True),
                              gold=chunk[s.index].answer, reference=chunk[s.index].reference,
                              extra=chunk[s.index].extra) for s in samples]
        outputs, _ = rewards.score(inputs)
        for s, out in zip(samples, outputs):
            scores[start + s.index].append(float(out.score))
    return scores


def row_of(item, d) -> dict:
    """The candidate's row as training reads it, with its uid as `id`."""
    row = {"id": item.uid, d.prompt_key: item.prompt, d.answer_key: item.answer, d.source_key: item.data_source}
    if item.reference is not None:
        row[d.reference_key] = item.reference
    return {**row, **item.extra}


def summarise(items, scores, kept) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    kept_set = set(kept)
    for source in sorted({it.data_source for it in items}):
        idx = [i for i, it in enumerate(items) if it.data_source == source]
        sel = [i for i in idx if i in kept_set]
        out[source] = {"candidates": len(idx), "kept": len(sel),
                       "mean_score_all": sum(scores[i] for i in idx) / len(idx),
                       "mean_score_kept": sum(scores[i] for i in sel) / len(sel) if sel else float("nan")}
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    from megarl.config.cli import config_from_args
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
    from megarl.data.selection import domain_zscores, prompt_scores, select_hardest
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.types import SamplingParams
    from megarl.trainer.build import build_rewards

    cfg = config_from_args(a)
    cfg.model.hf_path = cfg.model.hf_path or a.hf  # a GenRM route judges with the policy unless reward.judge_path
    d, ro = cfg.data, cfg.rollout
    engine = BuiltinEngine.from_pretrained(a.hf)
    if engine.tokenizer is None:
        raise SystemExit(f"--hf {a.hf}: no tokenizer files in the model directory")
    data = load_prompt_dataset(a.candidates, prompt_key=d.prompt_key, answer_key=d.answer_key,
                               source_key=d.source_key, default_source=d.default_data_source,
                               reference_key=d.reference_key)
    data = tokenize_dataset(data, engine.tokenizer, template=d.prompt_template, max_prompt_len=d.max_prompt_len,
                            apply_chat_template=d.apply_chat_template)
    items = list(data.items)
    sampling = SamplingParams(n=a.samples, temperature=ro.temperature, top_p=ro.top_p,
                              max_new_tokens=ro.max_new_tokens, seed=a.seed)
    with build_rewards(cfg) as rewards:
        per_sample = score_candidates(engine, rewards, items, sampling, a.batch_prompts)
    scores = prompt_scores(per_sample)
    domains = [it.data_source for it in items]
    z = domain_zscores(scores, domains)
    kept = select_hardest(scores, domains, a.fraction)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        if a.merge_with:
            for line in Path(a.merge_with).read_text().splitlines():
                if line.strip():
                    f.write(line.rstrip("\n") + "\n")
        for i in kept:
            f.write(json.dumps({**row_of(items[i], d), "pre_ppo_score": scores[i], "pre_ppo_z": z[i]}) + "\n")
    summary = {"candidates": len(items), "skipped_rows": len(data.skipped), "too_long": len(data.too_long),
               "kept": len(kept), "samples_per_prompt": a.samples, "by_source": summarise(items, scores, kept)}
    Path(str(out) + ".summary.json").write_text(json.dumps(summary, indent=1))
    for source, s in summary["by_source"].items():
        print(f"{source}: kept {s['kept']}/{s['candidates']}  mean score all={s['mean_score_all']:.3f} "
              f"kept={s['mean_score_kept']:.3f}")
    print(f"select_prompts: kept={len(kept)} of {len(items)} (skipped {len(data.skipped)} bad rows, "
          f"{len(data.too_long)} too long) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
