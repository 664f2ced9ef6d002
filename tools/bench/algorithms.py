"""Benchmark megarl.algorithms against naive per-sequence Python references (CPU, fp32).

    .venv/bin/python -m tools.bench.algorithms [--batch 512] [--tokens 20480] [--naive-rows 4]

Prints, for GAE, policy_loss and grpo_advantages, the vectorised time, the naive reference time
and their ratio, both in wall-clock and in this process's CPU time (the CPU-time ratio is the one
to trust on a shared, loaded machine; the load average is printed). The pure-Python GAE reference is too slow for the full batch: it is timed on
--naive-rows rows and extrapolated linearly to the batch (stated in the output). Each vectorised
timing is the best of --repeats runs. Also checks that both give the same numbers.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.bench.algorithms`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/bench/
    __import__("tools").run_as_module(__file__)

import argparse
import os
import time

import torch

from megarl.algorithms import compute_gae, grpo_advantages, place_outcome_reward, policy_loss
from tools._options import add_options


def best_of(fn, repeats: int) -> tuple[tuple[float, float], object]:
    """((best wall seconds, best CPU seconds of this process), last output)."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return (wall, cpu), out


def scaled(t: tuple[float, float], factor: float) -> tuple[float, float]:
    return (t[0] * factor, t[1] * factor)


def naive_gae_rows(r, v, m, gamma, lam):
    """verl's backward recursion, one sequence at a time, Python floats."""
    out = []
    for rr, vv, mm in zip(r.tolist(), v.tolist(), m.tolist()):
        T = len(rr)
        adv = [0.0] * T
        nextvalue = lastgaelam = 0.0
        for t in range(T - 1, -1, -1):
            if mm[t]:
                delta = rr[t] + gamma * nextvalue - vv[t]
                lastgaelam = delta + gamma * lam * lastgaelam
                nextvalue = vv[t]
                adv[t] = lastgaelam
        out.append(adv)
    return torch.tensor(out)


def column_loop_gae(r, v, m, gamma, lam):
    """verl's batched form: a Python loop over T on [B] columns."""
    B, T = r.shape
    mf = m.float()
    nextvalues = torch.zeros(B)
    lastgaelam = torch.zeros(B)
    adv = torch.empty(B, T)
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        new = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * mf[:, t] + (1 - mf[:, t]) * nextvalues
        lastgaelam = new * mf[:, t] + (1 - mf[:, t]) * lastgaelam
        adv[:, t] = lastgaelam
    return adv * mf


def naive_policy_loss(logp, old, adv, m, clip_low, clip_high):
    """Per-sequence loop computing the same outputs as policy_loss: token-mean loss, clip fractions,
    k3 approx_kl and ratio max (rows right-padded: row i's tokens are its first sum(m_i))."""
    total = count = high = low = kl = 0.0
    rmax = float("-inf")
    for i in range(logp.shape[0]):
        n = int(m[i].sum())
        if n == 0:
            continue
        log_ratio = (logp[i, :n] - old[i, :n]).clamp(-20, 20)
        ratio = torch.exp(log_ratio)
        a = adv[i, :n]
        per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
        total += float(per_tok.sum())
        high += float(((ratio > 1 + clip_high) & (a > 0)).sum())
        low += float(((ratio < 1 - clip_low) & (a < 0)).sum())
        kl += float((ratio - 1 - log_ratio).sum())
        rmax = max(rmax, float(ratio.max()))
        count += n
    return {"loss": total / count, "clipfrac_high": high / count, "clipfrac_low": low / count,
            "approx_kl": kl / count, "ratio_max": rmax}


def naive_grpo(scores, index, eps=1e-6):
    """verl-style: Python dict of per-group lists, then a per-sample loop."""
    groups: dict = {}
    s = scores.tolist()
    for x, g in zip(s, index):
        groups.setdefault(g, []).append(x)
    stats = {}
    for g, xs in groups.items():
        if len(xs) == 1:
            stats[g] = (0.0, 1.0)
        else:
            t = torch.tensor(xs)
            stats[g] = (float(t.mean()), float(t.std()))
    return torch.tensor([(x - stats[g][0]) / (stats[g][1] + eps) for x, g in zip(s, index)])


def row(name: str, fast: tuple[float, float], slow: tuple[float, float], note: str) -> None:
    print(
        f"{name:<34} vectorised {fast[0] * 1e3:9.1f} ms (cpu {fast[1] * 1e3:9.1f})   "
        f"naive {slow[0] * 1e3:10.1f} ms (cpu {slow[1] * 1e3:10.1f})   "
        f"ratio wall {slow[0] / fast[0]:6.1f}x cpu {slow[1] / max(fast[1], 1e-9):6.1f}x   {note}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_options(p, batch=512, tokens=20480, naive_rows=4, repeats=3, group_size=16, micro_batch_rows=8)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: cpu time = compute cost)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    B, T, k = args.batch, args.tokens, args.naive_rows
    torch.manual_seed(0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores (load avg {load}), B={B}, T={T}, fp32, CPU")

    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T) < lengths.unsqueeze(1)).to(torch.float32)
    rewards = place_outcome_reward(torch.randint(0, 2, (B,)).float(), mask)
    values = torch.randn(B, T) * 0.1
    gamma, lam = 1.0, 0.95

    # GAE
    t_fast, (adv, _) = best_of(lambda: compute_gae(rewards, values, mask, gamma, lam), args.repeats)
    t_naive, ref = best_of(lambda: naive_gae_rows(rewards[:k], values[:k], mask[:k], gamma, lam), 1)
    t_naive = scaled(t_naive, B / k)
    err = (adv[:k] - ref).abs().max().item()
    row("compute_gae", t_fast, t_naive, f"naive: pure-Python per-sequence loop timed on {k} rows, x{B // k} (linear extrapolation); max|diff| {err:.2e}")
    t_col, adv_col = best_of(lambda: column_loop_gae(rewards, values, mask, gamma, lam), 1)
    err = (adv - adv_col).abs().max().item()
    row("compute_gae vs column time loop", t_fast, t_col, f"reference: verl-style loop over T on [B] columns, full batch; max|diff| {err:.2e}")

    # policy loss
    old = -torch.rand(B, T) * 3
    logp = old + 0.1 * torch.randn(B, T)
    adv_pl = torch.randn(B, T)
    t_fast, (loss, met) = best_of(lambda: policy_loss(logp, old, adv_pl, mask, 0.2, 0.28), args.repeats)
    t_naive, ref = best_of(lambda: naive_policy_loss(logp, old, adv_pl, mask, 0.2, 0.28), 1)
    fast = {"loss": loss.item(), **{k: met[k].item() for k in ref if k != "loss"}}
    rel = max(abs(fast[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in ref)
    row("policy_loss (forward + metrics)", t_fast, t_naive, f"naive: per-sequence loop, same outputs, full batch; max rel diff {rel:.1e}")
    mb_rows = args.micro_batch_rows
    n_tok = mask.sum()

    def micro_batched():
        parts = [policy_loss(logp[i:i + mb_rows], old[i:i + mb_rows], adv_pl[i:i + mb_rows], mask[i:i + mb_rows],
                             0.2, 0.28, global_tokens=n_tok)[0] for i in range(0, B, mb_rows)]
        return torch.stack(parts).sum()

    t_mb, loss_mb = best_of(micro_batched, args.repeats)
    row(f"policy_loss as {B // mb_rows} micro-batches", t_mb, t_naive,
        f"same batch as the trainer calls it: {mb_rows}-row micro-batches with global_tokens; "
        f"sum of micro-batch losses - full loss = {abs(loss_mb.item() - loss.item()):.1e}")
    lp = logp.clone().requires_grad_(True)

    def fwd_bwd():
        loss, _ = policy_loss(lp, old, adv_pl, mask, 0.2, 0.28)
        loss.backward()
        lp.grad = None

    t_fb, _ = best_of(fwd_bwd, args.repeats)
    print(f"{'policy_loss forward+backward':<34} vectorised {t_fb[0] * 1e3:9.1f} ms (cpu {t_fb[1] * 1e3:9.1f})")

    # GRPO
    for n in (B, B * args.group_size):
        scores = torch.randint(0, 2, (n,)).float() + 0.1 * torch.randn(n)
        uid = [f"q{i // args.group_size}" for i in range(n)]
        uid_t = torch.arange(n) // args.group_size
        t_fast, a = best_of(lambda: grpo_advantages(scores, uid_t), args.repeats)
        t_naive, a_ref = best_of(lambda: naive_grpo(scores, uid), 1)
        t_str, _ = best_of(lambda: grpo_advantages(scores, uid), args.repeats)
        err = (a - a_ref).abs().max().item()
        row(f"grpo_advantages N={n}", t_fast, t_naive, f"naive: dict + per-sample loop; max|diff| {err:.2e}; with str uids {t_str[0] * 1e3:.1f} ms")


    print(f"load avg at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
