"""Training a pairwise generative reward model (Pairwise-RL, docs/algorithms.md §6; GenRM conventions §7)
on megarl's SFT path, exporting it as an HF model directory for `reward.judge_path`.

Data: preference pairs, JSONL rows {prompt, chosen, rejected} (the prompt is the policy's problem
text, as RewardInput.prompt). Each pair becomes two SFT rows, one per order, labels swapped
([NS→C] position-bias augmentation, §6):

    prompt = judge.pairwise_input_text(prompt, chosen, rejected)    response = A-label + verdict_suffix
    prompt = judge.pairwise_input_text(prompt, rejected, chosen)    response = B-label + verdict_suffix

`pairwise_input_text` is the exact direct-mode input of GenerativeJudge (template, chat rendering,
verdict prefix), so training and RL-time judging see the same text; the verdict (one token) is the
next token, as `GenerativeJudge` reads it, and `verdict_suffix` (default "]]") closes it as in
"Verdict: [[A]]". The judge's template, labels, prefix and chat use come from `reward.judge`
(JudgeConfig fields); the training settings from `reward.judge_train` (JudgeTrainConfig fields).

Held-out accuracy (`pairwise_accuracy`): with the debiased win probability of the chosen response
r = ½·(P(A | chosen first) + 1 − P(A | chosen second)), a pair counts as correct when r > 0.5;
per order, when the judge puts more mass on the chosen response's label in that order.
"""

from __future__ import annotations

from megarl.config import MegaRLConfig

import copy
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class JudgeTrainConfig:
    steps: int = 400  # SFT optimizer steps
    lr: float = 1.0e-3
    lr_warmup_steps: int = 10
    batch_size: int = 64  # SFT rows (one order of a pair each) per step
    max_len: int = 256  # longer rows are skipped and counted
    verdict_suffix: str = "]]"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.judge_train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"reward.judge_train.lr must be > 0, got {self.lr}")


def judge_train_config(cfg: MegaRLConfig, overrides: dict | None = None) -> JudgeTrainConfig:
    """JudgeTrainConfig from reward.judge_train (+ `overrides`); an error names the field."""
    opts = {**dict(cfg.reward.get("judge_train") or {}), **(overrides or {})}
    unknown = sorted(set(opts) - {f.name for f in fields(JudgeTrainConfig)})
    if unknown:
        raise ValueError(f"reward.judge_train: unknown field(s) {unknown} "
                         f"(known: {[f.name for f in fields(JudgeTrainConfig)]})")
    for f in fields(JudgeTrainConfig):  # a free-form mapping: "2e-3" may arrive as a string
        if f.name in opts:
            kind = type(f.default)
            try:
                if isinstance(opts[f.name], bool) or (kind is int and float(opts[f.name]) != int(float(opts[f.name]))):
                    raise ValueError
                opts[f.name] = kind(float(opts[f.name])) if kind in (int, float) else kind(opts[f.name])
            except (TypeError, ValueError):
                raise ValueError(f"reward.judge_train.{f.name} must be a {kind.__name__}, got {opts[f.name]!r}") from None
    return JudgeTrainConfig(**opts)


def text_judge(cfg: MegaRLConfig, tokenizer):
    """A GenerativeJudge with the config's reward.judge settings and no engine: renders texts."""
    from megarl.rewards.genrm import GenerativeJudge, judge_config

    return GenerativeJudge(None, tokenizer, judge_config(cfg.reward.get("judge"), "reward.judge"))


def load_pairs(path: str | Path) -> list[dict[str, str]]:
    """Preference pairs from JSONL; rows that are not JSON objects with non-empty string fields
    prompt / chosen / rejected (chosen != rejected) are skipped, counted and named in a warning."""
    pairs, skipped = [], []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"preference pairs: {path} does not exist")
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
            pair = {k: row[k] for k in ("prompt", "chosen", "rejected")}
            if not all(isinstance(v, str) and v for v in pair.values()) or pair["chosen"] == pair["rejected"]:
                raise ValueError("prompt/chosen/rejected must be non-empty strings, chosen != rejected")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            skipped.append((n, f"{type(e).__name__}: {e}"))
            continue
        pairs.append(pair)
    if skipped:
        log.warning("%s: skipped %d bad pair rows, e.g. %s", path, len(skipped), skipped[:3])
    if not pairs:
        raise ValueError(f"{path}: no usable preference pairs ({len(skipped)} skipped)")
    return pairs


def pair_sft_rows(pairs: list[dict[str, str]], judge, verdict_suffix: str = "]]") -> list[dict[str, str]]:
    """Two SFT rows per pair: (chosen, rejected) -> first label, (rejected, chosen) -> second label."""
    first, second = judge.cfg.pair_labels
    rows = []
    for p in pairs:
        rows.append({"prompt": judge.pairwise_input_text(p["prompt"], p["chosen"], p["rejected"]),
                     "response": first + verdict_suffix})
        rows.append({"prompt": judge.pairwise_input_text(p["prompt"], p["rejected"], p["chosen"]),
                     "response": second + verdict_suffix})
    return rows


def pairwise_accuracy(judge, pairs: list[dict[str, str]]) -> dict[str, float]:
    """Held-out accuracy of `judge` on preference pairs, both orders (see the module doc)."""
    results = judge.pairwise([(p["prompt"], p["chosen"], p["rejected"], None) for p in pairs])
    valid = [r for r in results if r is not None]
    n = max(len(valid), 1)
    return {"accuracy": sum(r.score > 0.5 for r in valid) / n,
            "accuracy_chosen_first": sum(r.probs[0] > 0.5 for r in valid) / n,
            "accuracy_chosen_second": sum(r.probs[1] < 0.5 for r in valid) / n,
            "mean_win_prob": sum(r.score for r in valid) / n,
            "pairs": float(len(pairs)), "no_verdict": float(len(pairs) - len(valid))}


def export_hf(ckpt: str | Path, out_dir: str | Path, dtype: str = "fp32") -> None:
    """Collective over the ranks: the model checkpoint `ckpt` (torch_dist, this TP/PP) as an HF
    directory (safetensors + config + tokenizer) at `out_dir` (tools/convert_checkpoint.py's
    megatron-to-hf, in-process); rank 0 writes."""
    from megatron.core import parallel_state as ps

    from megarl.models import build_model
    from megarl.weights import (consume, load_checkpoint_hf_config, load_megatron_checkpoint, read_checkpoint_meta,
                                save_hf_checkpoint, stream_hf_weights)
    from megarl.weights.dist_ckpt import padded_vocab_for

    hf_config = load_checkpoint_hf_config(ckpt)
    model = build_model(hf_config, dtype=dtype,
                        padded_vocab=padded_vocab_for(read_checkpoint_meta(ckpt), ps.get_tensor_model_parallel_world_size()))
    load_megatron_checkpoint(model, ckpt)
    stream = stream_hf_weights(model, hf_config, bucket_bytes=64 << 20, receive=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        save_hf_checkpoint(stream, out_dir, hf_config, hf_source_dir=Path(ckpt) / "hf")
    else:
        consume(stream)


def train_pairwise_judge(cfg: MegaRLConfig, train_pairs: str | Path, eval_pairs: str | Path | None, out_dir: str | Path,
                         init_load: str | None = None, overrides: dict | None = None) -> dict:
    """Every rank (under torch.distributed with cfg.parallel): renders the pairs (both orders),
    runs `megarl sft` from `init_load` (a model checkpoint; default cfg.model.load) into
    <out_dir>/ckpt, exports <out_dir>/hf and, with `eval_pairs`, measures the exported judge's
    held-out accuracy (rank 0; written to <out_dir>/judge_eval.json and logged). Returns
    {"hf_dir", "steps", "final_nll", "rows", **accuracy}."""
    from megarl.parallel.distributed import init_distributed
    from megarl.trainer.build import build_judge, load_hf_config_and_tokenizer
    from megarl.trainer.sft import sft

    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    tcfg = judge_train_config(cfg, overrides)
    out = Path(out_dir).resolve()
    rows_path, hf_dir, result_path = out / "pair_sft.jsonl", out / "hf", out / "judge_eval.json"
    rank0 = dist.get_rank() == 0
    if rank0:
        _, tokenizer = load_hf_config_and_tokenizer(cfg.model.hf_path)
        rows = pair_sft_rows(load_pairs(train_pairs), text_judge(cfg, tokenizer), tcfg.verdict_suffix)
        out.mkdir(parents=True, exist_ok=True)
        with rows_path.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        log.info("judge training rows: %d (%s), e.g. %r", len(rows), rows_path, rows[0])
    dist.barrier()
    jcfg = copy.deepcopy(cfg)
    jcfg.model.load = init_load or cfg.model.load
    jcfg.trainer.run_dir = str(out)
    jcfg.sft.data_path, jcfg.sft.max_steps, jcfg.sft.lr = str(rows_path), tcfg.steps, tcfg.lr
    jcfg.sft.lr_warmup_steps, jcfg.sft.batch_size, jcfg.sft.max_len = tcfg.lr_warmup_steps, tcfg.batch_size, tcfg.max_len
    trained = sft(jcfg, save_to=str(out / "ckpt"))
    export_hf(trained["checkpoint"], hf_dir, cfg.model.dtype)
    dist.barrier()
    result = {"hf_dir": str(hf_dir), "steps": trained["steps"], "final_nll": trained["final_nll"],
              "train_config": asdict(tcfg)}
    if eval_pairs is not None:
        if rank0:
            judge = build_judge(str(hf_dir), {**dict(cfg.reward.get("judge") or {}), "exact": True})
            acc = pairwise_accuracy(judge, load_pairs(eval_pairs))
            result_path.write_text(json.dumps({**result, **acc}, indent=2))
            log.info("judge held-out accuracy: %s", acc)
            print(f"genrm: held-out pairwise accuracy {acc['accuracy']:.3f} (both orders, debiased; "
                  f"chosen first {acc['accuracy_chosen_first']:.3f}, chosen second "
                  f"{acc['accuracy_chosen_second']:.3f}; {int(acc['pairs'])} pairs) judge={hf_dir}", flush=True)
        dist.barrier()
        result.update({k: v for k, v in json.loads(result_path.read_text()).items() if k not in result})
    return result
