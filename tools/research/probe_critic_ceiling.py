"""How much of the arithmetic quickstart's return variance a critic could explain (issue: a critic
that learns). Samples the policy, scores the samples, and reports token-level explained variances
of these values on the same rollouts (EV = 1 - Var(R - V) / Var(R) over response tokens, the
trainer's `critic/explained_variance` with lambda_critic = 1):

- oracle: V(t) = -1 once the response has departed from the reference chain of thought before
  token t (the wrong character is visible to the state before t), else the mean return of the
  tokens with no visible departure. A critic that detects every written error perfectly, and
  knows nothing else, scores this. `oracle_by_position`: the same detector that also knows the
  token's position (V = the mean return of the error-free tokens at that position).
- linear probe, per trunk: a ridge regression from the trunk's last hidden state before token t
  to the return, fitted on 80% of the prompts and scored on the rest (what a value head on that
  frozen trunk can read).
- fitted critic (`--fit-steps`): trunk and head trained together offline on the same split, with
  many more optimizer steps than a quickstart run gives the critic (`fit_critic`).
- critic from a process reward model (`--prm-synthetic P --prm-steps N`): the critic's trunk and head
  first fitted to step labels of synthetic chains of thought (`noisy_cot`: the quickstart's
  procedure written with each digit wrong with probability P; +1 before the first error, the
  outcome after it: `prm_token_targets`), as VAPO / VC-PPO start the critic from a reward model and
  the code-PRM paper from a PRM; then `--fit-steps` of value fitting on the policy's returns.
- true value (`--mc-continuations K`): the policy's own value function, V(s_t) = E[R | prefix],
  estimated at every `--mc-stride`-th response position by K fresh continuations of that prefix
  from the same policy (`true_value_ev`, corrected for the estimate's noise). No critic that reads
  the prefix can explain more of the return on average than this: it is the ceiling of the
  trainer's `critic/explained_variance` for this policy.

    python -m tools.research.probe_critic_ceiling --policy POLICY_HF --trunks A_HF,B_HF --task runs/x/task/train.jsonl
    python -m tools.research.probe_critic_ceiling --policy POLICY_HF --task ... --prompts 2000 --fit-steps 500
    python -m tools.research.probe_critic_ceiling --policy POLICY_HF --task ... --prompts 160 --samples 2 --mc-continuations 16
    python -m tools.research.probe_critic_ceiling --policy POLICY_HF --task ... --prm-synthetic 0.03 --prm-problems SFT_JSONL \
        --prm-steps 1000 --fit-steps 80 --report-every 20

HF dirs come from `tools/convert_checkpoint.py megatron-to-hf`. Byte-level tokenizer assumed (the
quickstart's: one token per character), as the oracle maps characters to tokens.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.research.probe_critic_ceiling`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not tools/research/
    __import__("tools").run_as_module(__file__)

import argparse
import json
from pathlib import Path

import torch
from tools._options import add_options



def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    return float(1 - (returns - values).var() / returns.var())


def first_departure(text: str, reference: str) -> int:
    """Index of the first character where `text` leaves `reference` (len of the shorter if none)."""
    return next((i for i, (x, y) in enumerate(zip(text, reference)) if x != y), min(len(text), len(reference)))


def visible_error_at(text: str, reference: str, ret: float) -> int | None:
    """The first response position whose state sees a departure from `reference` (the token after
    the first differing character), or None for a sample scored right."""
    return None if ret > 0 else min(first_departure(text, reference), max(len(text) - 1, 0)) + 1


def prm_token_targets(text: str, reference: str, ret: float, n: int) -> list[float]:
    """Process-reward labels of one response's n tokens: +1 while every step written so far is
    right (the PRM convention), the outcome `ret` from the first token that sees an error."""
    err = visible_error_at(text, reference, ret)
    return [ret if err is not None and t >= err else 1.0 for t in range(n)]


def noisy_cot(a: int, b: int, p: float, rng) -> str:
    """The quickstart's chain of thought for a + b written by a noisy executor: every digit it
    reads or writes (operand digits, column sum, answer so far, final answer) is replaced by a
    random other digit with probability p, and later steps work from what was written (the carry is
    the written sum's tens digit), as the policy's own errors propagate."""
    def noisy(digits: str) -> str:
        return "".join(str(rng.choice([d for d in range(10) if d != int(c)])) if rng.random() < p else c
                       for c in digits)

    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry, so_far = [], 0, ""
    n = max(len(da), len(db))
    for i in range(n):
        x = int(noisy(da[i] if i < len(da) else "0"))
        y = int(noisy(db[i] if i < len(db) else "0"))
        s = int(noisy(str(x + y + carry)))
        so_far = noisy((str(s) if i == n - 1 else str(s % 10)) + so_far)
        lines.append(f"{x}+{y}+{carry}={s} {so_far}")
        carry = s // 10
    return "\n".join(lines + [f"Answer: {noisy(so_far)}"])


def oracle_values(samples: list[tuple[str, str, float, int]],
                  by_position: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """samples: (response text, reference, return, n tokens) -> (returns, oracle values, share of
    tokens after a visible departure) over all response tokens. The value of a token with no
    visible departure is the mean return of all such tokens, or with `by_position` of those at the
    same response position (late tokens with no error yet are more often right: the Bayes value of a
    detector that also knows how far the response has got)."""
    seen, rets, pos = [], [], []
    for text, ref, ret, n in samples:
        err = visible_error_at(text, ref, ret)
        seen += [err is not None and t >= err for t in range(n)]
        rets += [ret] * n
        pos += list(range(n))
    seen_t, r, pos_t = torch.tensor(seen), torch.tensor(rets, dtype=torch.float64), torch.tensor(pos)
    clean = r.new_full(r.shape, float(r[~seen_t].mean()))
    if by_position:
        for t in pos_t.unique():
            at = (pos_t == t) & ~seen_t
            if at.any():
                clean[pos_t == t] = r[at].mean()
    v = torch.where(seen_t, torch.tensor(-1.0, dtype=torch.float64), clean)
    return r, v, float(seen_t.double().mean())


def true_value_ev(returns: torch.Tensor, mc_means: torch.Tensor, mc_sq_errors: torch.Tensor) -> float:
    """Explained variance of the true value function V*(s_t) = E[R | s_t], from Monte-Carlo
    estimates V^ = the mean of K continuation returns from s_t, independent of the sample's own R:

        EV* = 1 - (Var(R - V^) - mean(s_t^2 / K)) / Var(R)

    Var(R - V^) = Var(R - V*) + E[(V^ - V*)^2] since the continuations are independent of R given
    s_t, and s_t^2 / K (the continuations' unbiased variance over K, `mc_sq_errors`) estimates
    E[(V^ - V*)^2] without bias, so EV* is unbiased for the ceiling up to the ratio's estimate."""
    return float(1 - ((returns - mc_means).var() - mc_sq_errors.mean()) / returns.var())


def mc_true_values(engine, tok, samples, totals: list[int], returns: list[float], k: int, stride: int,
                   temperature: float, seed: int,
                   max_new_tokens: int = 80) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every `stride`-th position t of each sampled response (`engine` Samples, scored
    `returns`), K fresh continuations of prompt + response[:t] from `engine`'s policy. Returns per
    scored token (return R, MC mean V^, s^2/K, position t)."""
    from megarl.rollout import SamplingParams

    if k < 2:
        raise ValueError(f"--mc-continuations must be >= 2 (the noise correction needs a variance), got {k}")
    out_r, out_v, out_e, out_t = [], [], [], []
    longest = max(len(s.response_ids) for s in samples)
    for t in range(0, longest, stride):
        live = [i for i, s in enumerate(samples) if len(s.response_ids) > t]
        conts = engine.generate([samples[i].prompt_ids + samples[i].response_ids[:t] for i in live],
                                SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens - t,
                                               seed=seed * 1000 + t))
        rets = torch.tensor([score(tok.decode(samples[live[c.index]].response_ids[:t] + c.response_ids,
                                              skip_special_tokens=True), totals[live[c.index]])
                             for c in conts], dtype=torch.float64).view(len(live), k)
        out_r += [returns[i] for i in live]
        out_v.append(rets.mean(1))
        out_e.append(rets.var(1) / k)
        out_t += [t] * len(live)
    return (torch.tensor(out_r, dtype=torch.float64), torch.cat(out_v), torch.cat(out_e), torch.tensor(out_t))


def score(text: str, total: int) -> float:
    """The quickstart's +1 / -1 outcome: the last line is `Answer: <a+b>`."""
    return 1.0 if text.strip().split("\n")[-1] == f"Answer: {total}" else -1.0


def ridge_probe(x: torch.Tensor, y: torch.Tensor, held_out: torch.Tensor, lam: float = 1e-2) -> tuple[float, float]:
    """(train EV, held-out EV) of ridge regression y ~ [x, 1]."""
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    a = x[~held_out]
    w = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1], dtype=a.dtype), a.T @ y[~held_out])
    return explained_variance(y[~held_out], a @ w), explained_variance(y[held_out], x[held_out] @ w)


def load_critic(trunk_dir: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(trunk, head): `trunk_dir`'s backbone and a zero-initialised linear value head."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_pretrained(trunk_dir, dtype=torch.float32)
    head = torch.nn.Linear(lm.config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    return lm.model, head


def fit_critic(critic: tuple[torch.nn.Module, torch.nn.Linear], seqs: list[tuple[list[int], list[int], float]],
               held: list[bool], steps: int, lr: float = 3e-4, batch: int = 64, report_every: int = 250,
               seed: int = 0, token_targets: list[list[float]] | None = None, report_start: bool = False,
               tag: str = "fit") -> list[dict]:
    """A critic fitted offline with far more optimizer steps than the loop gives it: `critic`
    (`load_critic`: a backbone and a linear head, all trained, in place), MSE between the value
    before each response token and the sequence's return (lambda = 1), AdamW with a 20-step
    warm-up, on the sequences (prompt ids, response ids, return) not `held`. Returns {step,
    train_ev, heldout_ev} every `report_every` steps, and at step 0 with `report_start` (EV against
    the returns, over at most 1,200 sequences of each side).

    `token_targets` (one value per response token of each sequence) replaces the return as the
    regression target, e.g. the oracle's error-detector values: can the critic learn to detect
    the errors when told where they are? The log then also holds `heldout_target_ev`, the EV of
    the held-out values against those targets."""
    import random

    torch.manual_seed(seed)
    trunk, head = critic
    params = [*trunk.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    targets = token_targets or [[ret] * len(r) for _, r, ret in seqs]
    seqs = [(p, r, ret, torch.tensor(t, dtype=torch.float32)) for (p, r, ret), t in zip(seqs, targets)]

    def values(rows):
        width = max(len(p) + len(r) for p, r, _, _ in rows)
        ids, att = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
        for i, (p, r, _, _) in enumerate(rows):
            ids[i, : len(p) + len(r)], att[i, : len(p) + len(r)] = torch.tensor(p + r), 1
        v = head(trunk(input_ids=ids, attention_mask=att).last_hidden_state).squeeze(-1)
        return (torch.cat([v[i, len(p) - 1: len(p) - 1 + len(r)] for i, (p, r, _, _) in enumerate(rows)]),
                torch.cat([torch.full((len(r),), ret) for p, r, ret, _ in rows]),
                torch.cat([t for _, _, _, t in rows]))

    @torch.no_grad()
    def ev(rows, against_targets=False):
        trunk.eval()
        v, r, t = map(torch.cat, zip(*(values(rows[i: i + 256]) for i in range(0, len(rows), 256))))
        trunk.train()
        return explained_variance((t if against_targets else r).double(), v.double())

    train = [x for x, h in zip(seqs, held) if not h]
    test = [x for x, h in zip(seqs, held) if h]
    rng, log = random.Random(seed), []
    for step in range(0 if report_start else 1, steps + 1):
        if step:
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, step / 20)
            v, _, t = values(rng.sample(train, batch))
            opt.zero_grad()
            ((v - t) ** 2).mean().backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        if step % report_every == 0:
            log.append({"step": step, "train_ev": ev(train[:1200]), "heldout_ev": ev(test[:1200])})
            extra = ""
            if token_targets:
                log[-1]["heldout_target_ev"] = ev(test[:1200], against_targets=True)
                extra = f" critic_heldout_target_ev={log[-1]['heldout_target_ev']:.3f}"
            print(f"{tag} step={step} critic_train_ev={log[-1]['train_ev']:.3f} critic_heldout_ev={log[-1]['heldout_ev']:.3f}"
                  + extra, flush=True)
    return log


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="HF dir of the policy that samples")
    p.add_argument("--trunks", default="", help="comma-separated HF dirs whose hidden states are probed")
    p.add_argument("--task", required=True, help="arith prompt rows (problem, answer)")
    add_options(p, prompts=160, samples=8, temperature=1.0, seed=1)
    p.add_argument("--fit-steps", type=int, default=0,
                   help="also fit a critic (--fit-trunk, else the first --trunks dir, else the policy; all trained) "
                        "for this many steps")
    p.add_argument("--fit-trunk", default="", help="HF dir the fitted critic starts from (same tokenizer as the policy)")
    p.add_argument("--fit-target", choices=["return", "oracle"], default="return",
                   help="what the fitted critic regresses to: the return, or the oracle's per-token values")
    p.add_argument("--fit-lr", type=float, default=3e-4)
    p.add_argument("--report-every", type=int, default=250, help="fitted critics: report EVs every n steps")
    p.add_argument("--prm-synthetic", type=float, default=0.0,
                   help="P: before the value fit, fit the critic to the step labels of synthetic chains of "
                        "thought written with each digit wrong with probability P (a process reward model)")
    p.add_argument("--prm-problems", default="", help="arith rows (problem) the synthetic chains are written for, "
                                                       "e.g. the run's sft.jsonl (disjoint from --task)")
    p.add_argument("--prm-steps", type=int, default=1000)
    p.add_argument("--mc-continuations", type=int, default=0,
                   help="K: estimate the true value function's EV from K continuations per scored position")
    p.add_argument("--mc-stride", type=int, default=1, help="score every n-th response position")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM  # after the arguments: --help stays quick

    from megarl.data.templates import apply_template
    from megarl.rollout import SamplingParams
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.tasks.arith import cot_lines

    rows = [json.loads(x) for x in Path(a.task).read_text().splitlines()[: a.prompts]]
    engine = BuiltinEngine.from_pretrained(a.policy)
    tok = engine.tokenizer
    out = engine.generate([tok.encode(apply_template("arith", r["problem"])) for r in rows],
                          SamplingParams(n=a.samples, temperature=a.temperature, max_new_tokens=80, seed=a.seed))
    samples, totals = [], []
    for s in out:
        x, y = map(int, rows[s.index]["problem"].split("+"))
        lines, total = cot_lines(x, y)
        text = tok.decode(s.response_ids, skip_special_tokens=True)
        samples.append((text, "\n".join(lines + [f"Answer: {total}"]), score(text, total), len(s.response_ids)))
        totals.append(total)
    r, v, after = oracle_values(samples)
    acc = sum(s[2] > 0 for s in samples) / len(samples)
    print(f"samples={len(samples)} accuracy={acc:.3f} tokens={len(r)} return_var={float(r.var()):.3f} "
          f"oracle_ev={explained_variance(r, v):.3f} tokens_after_visible_error={after:.3f} "
          f"oracle_by_position_ev={explained_variance(r, oracle_values(samples, by_position=True)[1]):.3f}", flush=True)
    if a.mc_continuations:
        mr, mv, me, mt = mc_true_values(engine, tok, out, totals, [ret for _, _, ret, _ in samples],
                                        a.mc_continuations, a.mc_stride, a.temperature, a.seed + 1)
        def ev_where(m):
            return true_value_ev(mr[m], mv[m], me[m])

        parts = " ".join(f"t{lo}-{lo + 15}={ev_where((mt >= lo) & (mt < lo + 16)):.3f}"
                         for lo in range(0, int(mt.max()) + 1, 16))
        print(f"true_value_ev={ev_where(mt >= 0):.3f} (K={a.mc_continuations}, {len(mr)} scored tokens, "
              f"stride {a.mc_stride}) first_token_ev={ev_where(mt == 0):.3f} by_position: {parts}", flush=True)
    held = torch.cat([torch.full((n,), s.index % 5 == 0) for s, (_, _, _, n) in zip(out, samples)])
    for trunk in [t for t in a.trunks.split(",") if t]:
        model = AutoModelForCausalLM.from_pretrained(trunk, dtype=torch.float32).eval()
        feats = []
        with torch.no_grad():
            for s in out:
                h = model(torch.tensor([s.prompt_ids + s.response_ids]), output_hidden_states=True).hidden_states[-1][0]
                n0 = len(s.prompt_ids) - 1
                feats.append(h[n0: n0 + len(s.response_ids)].double())
        train_ev, held_ev = ridge_probe(torch.cat(feats), r, held)
        print(f"trunk={trunk} probe_train_ev={train_ev:.3f} probe_heldout_ev={held_ev:.3f}", flush=True)
    if a.fit_steps or a.prm_synthetic:
        critic = load_critic(([a.fit_trunk] if a.fit_trunk else [t for t in a.trunks.split(",") if t] or [a.policy])[0])
        if a.prm_synthetic:
            fit_prm(critic, tok, a.prm_problems, a.prm_synthetic, a.prm_steps, a.fit_lr, a.seed)
        ns = [n for _, _, _, n in samples]
        per_sample = list(torch.split(v, ns)) if a.fit_target == "oracle" else None
        fit_critic(critic, [(s.prompt_ids, s.response_ids, ret) for s, (_, _, ret, _) in zip(out, samples)],
                   [s.index % 5 == 0 for s in out], a.fit_steps, lr=a.fit_lr, report_every=a.report_every,
                   token_targets=[x.tolist() for x in per_sample] if per_sample else None,
                   report_start=bool(a.prm_synthetic))


def fit_prm(critic, tok, problems: str, p: float, steps: int, lr: float, seed: int) -> None:
    """Fit `critic` to `prm_token_targets` of one `noisy_cot` per problem row of `problems` (a
    fifth of the rows held out), the byte-level tokenizer's ids plus EOS; reports 4 times."""
    import random

    from megarl.data.templates import apply_template
    from megarl.tasks.arith import cot_response

    if not problems:
        raise SystemExit("--prm-synthetic needs --prm-problems (arith rows with a 'problem' field)")
    pairs = []
    for n, line in enumerate(Path(problems).read_text().splitlines(), 1):
        try:
            x, y = map(int, json.loads(line)["problem"].split("+"))
            pairs.append((x, y))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"{problems}:{n}: not an arith row with 'problem': '<a>+<b>' ({e!r})") from None
    rng, seqs, targets = random.Random(seed), [], []
    for x, y in pairs:
        text, ref = noisy_cot(x, y, p, rng), cot_response(x, y)
        ret = score(text, x + y)
        ids = tok.encode(text) + [tok.eos_token_id]
        seqs.append((tok.encode(apply_template("arith", f"{x}+{y}")), ids, ret))
        targets.append(prm_token_targets(text, ref, ret, len(ids)))
    print(f"prm: {len(seqs)} synthetic chains (p={p}), accuracy {sum(r > 0 for *_, r in seqs) / len(seqs):.3f}",
          flush=True)
    fit_critic(critic, seqs, [i % 5 == 0 for i in range(len(seqs))], steps, lr=lr, report_every=max(1, steps // 4),
               token_targets=targets, tag="prm fit")


if __name__ == "__main__":
    main()
