"""Probe: how fast does plain-PyTorch SFT teach the tiny Qwen2 model the arithmetic CoT task?

    .venv/bin/python -m tools.research.probe_arith_sft [--digits 3 --steps 400 --lr 2e-3 --batch 64 \
        --eval-every 25 --n-eval 200 --threads 1 --max-seconds 170]

Builds the byte tokenizer + a random tiny Qwen2 (`megarl.tasks.tiny_model`), generates task
data (`megarl.tasks.arith`), trains with AdamW on response tokens (+EOS) only, and every
--eval-every steps measures greedy exact-match accuracy on held-out problems (answer parsed from
the last line, compared to the true sum). Prints one line per eval: step, training wall seconds
and training CPU seconds (eval excluded; CPU seconds are the better measure on a shared machine
with --threads 1), loss, accuracy. --save/--resume chain runs (model + optimizer + data RNG, as
safetensors / weights_only torch.load) so each run stays short. Measurement tool only.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.probe_arith_sft`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import random
import time
from pathlib import Path

import torch


from megarl.tasks.arith import cot_response, extract_answer, problem_text, sample_operand  # noqa: E402
from megarl.data.templates import apply_template  # noqa: E402
from megarl.tasks.tiny_model import TinyModelSpec, build_byte_tokenizer, build_tiny_qwen2  # noqa: E402
from tools._options import add_options


def make_split(rng: random.Random, digits: int, n: int, taken: set) -> list[tuple[int, int]]:
    out = []
    while len(out) < n:
        pair = (sample_operand(rng, digits), sample_operand(rng, digits))
        if pair not in taken:
            taken.add(pair)
            out.append(pair)
    return out


def sft_batch(tok, pairs, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for a, b in pairs:
        p = tok(apply_template("arith", problem_text(a, b)))["input_ids"]
        r = tok(cot_response(a, b))["input_ids"] + [eos]
        seqs.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), eos, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(s)] = torch.tensor([t if k else -100 for t, k in zip(s, m)])
    return ids, lab


@torch.no_grad()
def greedy_accuracy(model, tok, pairs, max_new: int, eos: int) -> float:
    model.eval()
    prompts = [tok(apply_template("arith", problem_text(a, b)))["input_ids"] for a, b in pairs]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)
    correct = 0
    for (a, b), row in zip(pairs, out[:, width:].tolist()):
        text = tok.decode(row, skip_special_tokens=True)
        correct += extract_answer(text) == str(a + b)
    model.train()
    return correct / len(pairs)


def main() -> None:
    p = argparse.ArgumentParser()
    add_options(
        p, digits=3, layers=3, hidden=128, heads=4, kv_heads=2, intermediate=384, steps=400, lr=2e-3, warmup=10,
        batch=64, eval_every=25, n_eval=200, threads=1, seed=0)
    p.add_argument("--max-seconds", type=float, default=170.0, help="stop when the run's wall time exceeds this")
    p.add_argument("--save", default=None, help="save model/optimizer/step here at the end")
    p.add_argument("--resume", default=None, help="continue from a --save directory")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rng = random.Random(a.seed)
    tok = build_byte_tokenizer()
    eos = tok.eos_token_id
    spec = TinyModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                         intermediate=a.intermediate, seed=a.seed)
    model = build_tiny_qwen2(tok, spec)
    model.config._attn_implementation = "sdpa"
    n_params = sum(t.numel() for t in model.parameters())
    taken: set = set()
    eval_pairs = make_split(rng, a.digits, a.n_eval, taken)
    max_new = 10 * (a.digits + 1) + 2 * a.digits + 12
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup))
    print(f"params={n_params} digits={a.digits} lr={a.lr} batch={a.batch} threads={a.threads}", flush=True)
    train_s, train_cpu, start_step, t_start = 0.0, 0.0, 1, time.perf_counter()
    if a.resume:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(f"{a.resume}/model.safetensors"))
        state = torch.load(f"{a.resume}/trainer.pt", weights_only=True)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_step, train_s, train_cpu = state["step"] + 1, state["train_s"], state["train_cpu"]
        rng = random.Random(a.seed + start_step)  # fresh SFT problems after resuming (eval stays disjoint)
    step = start_step - 1
    for step in range(start_step, a.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        ids, lab = sft_batch(tok, make_split(rng, a.digits, a.batch, taken), eos)
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        train_s += time.perf_counter() - t0
        train_cpu += time.process_time() - c0
        out_of_time = time.perf_counter() - t_start > a.max_seconds
        if step % a.eval_every == 0 or step == a.steps or out_of_time:
            t1 = time.perf_counter()
            acc = greedy_accuracy(model, tok, eval_pairs, max_new, eos)
            t_eval = time.perf_counter() - t1
            print(f"step={step:4d} train_wall_s={train_s:6.1f} train_cpu_s={train_cpu:6.1f} loss={loss.item():.4f} "
                  f"greedy_acc={acc:.3f} (eval {t_eval:.1f}s)", flush=True)
        if out_of_time:
            break
    if a.save:
        from safetensors.torch import save_file
        Path(a.save).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{a.save}/model.safetensors")
        torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "train_s": train_s,
                    "train_cpu": train_cpu}, f"{a.save}/trainer.pt")


if __name__ == "__main__":
    main()
