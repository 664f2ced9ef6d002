"""Probe: plain single-process GRPO on the arithmetic task, without megarl's trainer.

    .venv/bin/python -m tools.research.probe_arith_grpo --init HF_DIR --task-dir TASK_DIR \
        [--steps 40 --prompts 32 --samples 8 --mini-batch 64 --lr 1e-4 --threads 2]

The yardstick for the quickstart: how fast does the simplest GRPO loop (HF `generate` at T=1,
binary reward from `megarl.tasks.arith.extract_answer`, group-normalised advantages and the
token-mean clipped surrogate from `megarl.algorithms`, AdamW, grad clip 1.0) raise greedy
accuracy from a given SFT checkpoint? HF_DIR is an HF model + tokenizer (e.g. the quickstart's
SFT actor exported with `tools/convert_checkpoint.py megatron-to-hf`); TASK_DIR holds
train.jsonl / eval.jsonl from `megarl.tasks.arith.write_task_files`. Prints one line per step
(train accuracy, mixed-group fraction, wall seconds) and greedy eval accuracy every --eval-every
steps. Measurement tool only.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.probe_arith_grpo`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import json
import random
import time
from pathlib import Path

import torch


from megarl.algorithms.losses import policy_loss  # noqa: E402
from megarl.algorithms.outcome import grpo_advantages  # noqa: E402
from megarl.data.templates import apply_template  # noqa: E402
from megarl.tasks.arith import extract_answer  # noqa: E402
from tools._options import add_options


@torch.no_grad()
def sample(model, tok, prompts: list[str], greedy: bool, max_new: int, temperature: float):
    """-> (prompt ids [B, P] left-padded, attention mask [B, P], response ids [B, R], response mask)."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", return_token_type_ids=False)
    kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    out = model.generate(**enc, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id, **kw)
    resp = out[:, enc.input_ids.shape[1]:]
    is_eos = resp == tok.eos_token_id
    last = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((len(resp),), resp.shape[1] - 1))
    resp_mask = (torch.arange(resp.shape[1])[None] <= last[:, None]).float()  # through the first EOS
    return enc.input_ids, enc.attention_mask, resp, resp_mask


def response_logprobs(model, prompt_ids, prompt_mask, resp, resp_mask, temperature: float) -> torch.Tensor:
    ids = torch.cat([prompt_ids, resp], 1)
    att = torch.cat([prompt_mask, resp_mask.long()], 1)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, prompt_ids.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)


def greedy_accuracy(model, tok, rows: list[dict], max_new: int) -> float:
    model.eval()
    _, _, resp, _ = sample(model, tok, [apply_template("arith", r["problem"]) for r in rows], True, max_new, 1.0)
    texts = tok.batch_decode(resp, skip_special_tokens=True)
    return sum(extract_answer(t) == r["answer"] for t, r in zip(texts, rows)) / len(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True, help="HF model + tokenizer directory")
    p.add_argument("--task-dir", required=True, help="directory with train.jsonl and eval.jsonl")
    add_options(p, steps=40, prompts=32, samples=8)
    p.add_argument("--mini-batch", type=int, default=64, help="samples per optimizer step")
    add_options(p, lr=1e-4, clip=0.2, temperature=1.0, max_new=80, eval_every=10, threads=2, seed=0)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # after the arguments: --help stays quick

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok = AutoTokenizer.from_pretrained(a.init)
    model = AutoModelForCausalLM.from_pretrained(a.init, dtype=torch.float32)
    task = Path(a.task_dir)
    train = [json.loads(ln) for ln in (task / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(ln) for ln in (task / "eval.jsonl").read_text().splitlines()]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    print(f"step=0 eval_greedy_acc={greedy_accuracy(model, tok, evals, a.max_new):.3f}", flush=True)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        rows = [r for r in rng.sample(train, a.prompts) for _ in range(a.samples)]
        model.eval()
        prompt_ids, prompt_mask, resp, resp_mask = sample(
            model, tok, [apply_template("arith", r["problem"]) for r in rows], False, a.max_new, a.temperature)
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        scores = torch.tensor([float(extract_answer(t) == r["answer"]) for t, r in zip(texts, rows)])
        groups = torch.arange(len(rows)) // a.samples
        adv = grpo_advantages(scores, groups)[:, None].expand_as(resp_mask)
        with torch.no_grad():
            old = torch.cat([response_logprobs(model, prompt_ids[i:i + 64], prompt_mask[i:i + 64], resp[i:i + 64],
                                               resp_mask[i:i + 64], a.temperature) for i in range(0, len(rows), 64)])
        model.train()
        for idx in torch.randperm(len(rows)).split(a.mini_batch):
            lp = response_logprobs(model, prompt_ids[idx], prompt_mask[idx], resp[idx], resp_mask[idx], a.temperature)
            loss, _ = policy_loss(lp, old[idx], adv[idx], resp_mask[idx], a.clip, a.clip, agg="token-mean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        mixed = (scores.view(-1, a.samples).std(1) > 0).float().mean()
        line = f"step={step} train_acc={scores.mean():.3f} mixed_groups={mixed:.2f} wall_s={time.perf_counter() - t0:.0f}"
        if step % a.eval_every == 0 or step == a.steps:
            line += f" eval_greedy_acc={greedy_accuracy(model, tok, evals, a.max_new):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
