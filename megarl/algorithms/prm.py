"""Line-level process reward model (PRM) for code RL: the pure parts (docs/algorithms.md §10,
"Process Supervision-Guided Policy Optimization for Code Generation", arXiv 2410.17621).

Lines. Line j (1-based) of a response is the span of tokens ending at the j-th token whose text
contains a newline ("line-end token", response index e_j). A trailing fragment with no newline
is not a line (it gets no dense reward and no PRM target).

Labels by binary search [S]. The prefix through line j is positive when any of K completions
sampled from prompt + response[: e_j + 1] passes the unit tests (best-of-K). For a response that
fails, the labeller binary-searches the first line j* after which no completion passes (the
"first unrecoverable error"), assuming prefix_passes is monotone (once unrecoverable, always):
lines 1..j*-1 are labelled 1, lines j*..n 0. The full response is the prefix through line n
plus its tail, which failed, so j* = n when every earlier prefix recovers. A response that
passes has all lines 1 and costs no oracle call. Oracle calls: ceil(log2 n).

PRM targets. The PRM (a critic-architecture model: LLM + scalar head) predicts
R(x, y_{<=j}) from the state that has read line j's last token. In the trainer's values view
(megarl.trainer.batch: view index t holds the output that predicts response token t, i.e. the
state after tokens < t) that is view index e_j + 1, which exists only when line j is not the
response's last token.

Dense reward [NS→C: the exact equation is not stated; the labelled common choice]:
    r_{e_j} = λ · R_φ(x, y_{<=j}) / n_lines,   λ = lambda_fail if the final code fails else lambda_pass
on the last token e_j of every scored line j, n_lines = the number of scored lines of the
response; added to the outcome unit-test reward on the EOS token (1 pass, 0 fail).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch


def line_end_indices(token_texts: Sequence[str]) -> list[int]:
    """Response indices of the line-end tokens: those whose text contains a newline."""
    return [t for t, s in enumerate(token_texts) if "\n" in s]


def line_end_mask(response_ids: Sequence[Sequence[int]], newline_ids: set[int] | frozenset[int],
                  width: int) -> torch.Tensor:
    """[B, width] 1.0 at the line-end tokens that have a next response token (the PRM reads line j
    at view index e_j + 1, so a line ending on the last response token is not scored)."""
    mask = torch.zeros(len(response_ids), width)
    for b, ids in enumerate(response_ids):
        for t, tok in enumerate(ids[: len(ids) - 1]):
            if tok in newline_ids:
                mask[b, t] = 1.0
    return mask


def binary_search_steps(n_lines: int) -> Generator[int, bool, int]:
    """The search as a coroutine: yields the line j to test, receives prefix_passes(j), returns
    j* (1-based first unrecoverable line) of a failing response with `n_lines` lines. Drive many
    of them in lockstep to batch the oracle's completions."""
    if n_lines < 1:
        raise ValueError(f"binary search needs a response with >= 1 line, got {n_lines}")
    lo, hi = 1, n_lines  # invariant: prefix_passes(lo - 1) (or lo == 1) and not prefix_passes(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if (yield mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def first_unrecoverable_line(n_lines: int, prefix_passes: Callable[[int], bool]) -> tuple[int, int]:
    """(j*, oracle calls) for a failing response; prefix_passes(j) for j in 1..n_lines-1."""
    search = binary_search_steps(n_lines)
    calls = 0
    try:
        j = next(search)
        while True:
            calls += 1
            j = search.send(bool(prefix_passes(j)))
    except StopIteration as done:
        return done.value, calls


def line_labels(n_lines: int, first_bad: int | None) -> list[float]:
    """1.0 for lines before `first_bad` (1-based), 0.0 from it on; first_bad None (the response
    passed): all 1.0."""
    if first_bad is None:
        return [1.0] * n_lines
    if not 1 <= first_bad <= n_lines:
        raise ValueError(f"first_bad must be in 1..{n_lines}, got {first_bad}")
    return [1.0] * (first_bad - 1) + [0.0] * (n_lines - first_bad + 1)


def prm_targets(line_ends: Sequence[int], labels: Sequence[float], response_len: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([width] targets, [width] mask) of one labelled response in the values view: label j at
    view index e_j + 1 (skipped when e_j + 1 >= response_len)."""
    if len(line_ends) != len(labels):
        raise ValueError(f"{len(line_ends)} line ends but {len(labels)} labels")
    target, mask = torch.zeros(width), torch.zeros(width)
    for e, y in zip(line_ends, labels):
        if e + 1 < response_len:
            target[e + 1], mask[e + 1] = float(y), 1.0
    return target, mask


def dense_line_rewards(prm_values: torch.Tensor, line_mask: torch.Tensor, passed: torch.Tensor,
                       lambda_fail: float, lambda_pass: float) -> torch.Tensor:
    """[B, T] r[b, e] = λ_b · prm_values[b, e + 1] / n_lines_b at the line ends e of line_mask
    (see the module doc), 0 elsewhere; λ_b = lambda_pass where passed[b] else lambda_fail."""
    score_at_end = torch.zeros_like(prm_values)
    score_at_end[:, :-1] = prm_values[:, 1:]
    n_lines = line_mask.sum(-1, keepdim=True).clamp(min=1.0)
    lam = torch.where(passed.bool(), torch.tensor(lambda_pass), torch.tensor(lambda_fail)).float().unsqueeze(1)
    return lam * score_at_end * line_mask / n_lines
