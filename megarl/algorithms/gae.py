"""GAE and its Seed variants: decoupled (VC-PPO), length-adaptive lambda (VAPO), EGAE (T-PPO),
turn-independent GAE (PAG), plus masked discounted returns (REINFORCE++).

Shapes: B sequences x T response tokens; `mask` [B, T] is 1 on tokens that count (policy
response tokens). Outputs are float32 (float64 if the inputs are), and 0 at masked positions.
Advantages are raw: whitening is a separate step (`masked.masked_whiten`). Everything here runs
under torch.no_grad(): advantages and returns are constants (targets) for the losses.

Masked positions (verl semantics, docs/algorithms.md §1.3): the backward recursion skips them: where
m_t = 0 the running `nextvalue` and `lastgaelam` pass through unchanged, so neither the value nor
the reward at a masked position enters any advantage. Equivalently GAE runs on the subsequence of
masked-in tokens: delta_t = r_t + gamma*V_next(t) - V_t, with V_next(t) the value at the next
masked-in position (0 after the last one, or a bootstrap value), and
A_t = delta_t + gamma*lam*A_next(t).
"""

from __future__ import annotations

import torch

from .scan import reverse_linear_scan

Lam = float | torch.Tensor


def _float_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO length-adaptive lambda (docs/algorithms.md §4): lam_i = 1 - 1/(alpha * l_i), clamped to [0, 1).

    l_i is response i's own valid length in tokens (not the padded length). For alpha*l <= 1
    (l <= 20 at alpha = 0.05) the formula is <= 0 and is clamped to 0 ([NS→C]); the upper clamp to
    the largest float below 1 only matters when rounding would give exactly 1. Returns float32 [B].
    """
    if alpha <= 0:
        raise ValueError(f"length_adaptive_lambda: alpha must be > 0, got {alpha}")
    l = lengths.to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * l).clamp(min=1e-30)
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    return lam.clamp(min=0.0, max=below_one)


def _next_values(
    values: torch.Tensor, m: torch.Tensor, bootstrap: torch.Tensor | None, turn_starts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V_next(t): value at the next masked-in position after t within t's turn, else bootstrap/0.

    A backward fill done with the same scan: y_t = m_t*V_t + (1-m_t)*(1-cut_t)*y_{t+1}, y_T = bootstrap,
    V_next(t) = (1-cut_t)*y_{t+1}. cut_t = turn_starts[t+1] (1 where the carry from t+1 into t is
    reset by a turn boundary), returned too (None without turn_starts).
    """
    B, T = values.shape
    tail = torch.zeros_like(values[:, 0]) if bootstrap is None else bootstrap.to(values.dtype)
    keep = 1.0 - m
    cut = None
    if turn_starts is not None:
        ts = turn_starts.to(values.dtype)
        cut = torch.cat([ts[:, 1:], torch.zeros_like(ts[:, :1])], dim=1)
        keep.mul_(1.0 - cut)
    filled = reverse_linear_scan(m * values, keep, init=tail)
    v_next = torch.cat([filled[:, 1:], tail.unsqueeze(1)], dim=1)
    if cut is not None:
        v_next.mul_(1.0 - cut)
    return v_next, cut


def _deltas_and_decay(token_rewards, values, mask, gamma, bootstrap, turn_starts):
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards: expected [B, T], got shape {tuple(token_rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    B, T = token_rewards.shape
    _check("values", values, (B, T))
    _check("mask", mask, (B, T))
    if turn_starts is not None:
        _check("turn_starts", turn_starts, (B, T))
    dt = _float_dtype(token_rewards, values)
    r, v, m = token_rewards.to(dt), values.to(dt), mask.to(dt)
    delta, cut = _next_values(v, m, bootstrap, turn_starts)
    # delta = m * (r + gamma * V_next - V), in place on the fresh V_next buffer
    delta.mul_(gamma).add_(r).sub_(v).mul_(m)
    return delta, m, v, cut


def _gae_scan(delta: torch.Tensor, m: torch.Tensor, gamma: float, lam: Lam, cut: torch.Tensor | None) -> torch.Tensor:
    """A_t = delta_t + a_t * A_{t+1} with a_t = gamma*lam*m_t + (1 - m_t), times (1 - cut_t)."""
    B = delta.shape[0]
    if isinstance(lam, torch.Tensor):
        lam_t = lam.to(delta.dtype).to(delta.device)
        if lam_t.dim() == 0:
            lam_t = lam_t.expand(B)
        _check("lam", lam_t, (B,))
        lam_t = lam_t.unsqueeze(1)
    else:
        lam_t = float(lam)
        if not 0.0 <= lam_t <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam_t}")
    a = m * (gamma * lam_t - 1.0)  # a = gamma*lam*m + (1 - m) = 1 + m*(gamma*lam - 1)
    a.add_(1.0)
    if cut is not None:
        a.mul_(1.0 - cut)
    return reverse_linear_scan(delta, a).mul_(m)


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: Lam = 1.0,
    *,
    bootstrap_values: torch.Tensor | None = None,
    turn_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (docs/algorithms.md §1.3). Returns (advantages, returns), [B, T] each.

    delta_t = r_t + gamma*V_{t+1} - V_t,  A_t = delta_t + gamma*lam*A_{t+1},  returns_t = A_t + V_t,
    with V after the last response token = 0 (finished sequence) or `bootstrap_values[b]` [B]
    (used by EGAE for truncated rows). Masked positions are skipped (module docstring) and are 0
    in both outputs. `lam` is a float or a per-sequence tensor [B] (VAPO, `length_adaptive_lambda`).

    `turn_starts` [B, T] (PAG turn-independent GAE, docs/algorithms.md §8): True at the first position of
    each turn. Crossing a turn start backwards resets nextvalue and lastgaelam to 0, so the last
    token of each turn bootstraps with 0 and no advantage flows between turns. The flag may sit on
    a masked template position or on the turn's first response token; both give the same result.

    No reduction is taken. Raw advantages: whiten separately.
    """
    delta, m, v, cut = _deltas_and_decay(token_rewards, values, mask, gamma, bootstrap_values, turn_starts)
    adv = _gae_scan(delta, m, gamma, lam, cut)
    return adv, (adv + v).mul_(m)


@torch.no_grad()
def decoupled_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam_actor: Lam = 0.95,
    lam_critic: Lam = 1.0,
    *,
    bootstrap_values: torch.Tensor | None = None,
    turn_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (VC-PPO / VAPO, docs/algorithms.md §3): two GAE passes over the same delta.

    advantages = A^{lam_actor} (policy; lam_actor may be per-sequence [B], e.g. length-adaptive),
    returns = A^{lam_critic} + V (critic target; lam_critic = 1, gamma = 1 gives the Monte-Carlo
    return). The critic target is NOT actor_advantages + V. Other arguments as in `compute_gae`.
    """
    delta, m, v, cut = _deltas_and_decay(token_rewards, values, mask, gamma, bootstrap_values, turn_starts)
    adv = _gae_scan(delta, m, gamma, lam_actor, cut)
    critic_adv = _gae_scan(delta, m, gamma, lam_critic, cut)
    return adv, critic_adv.add_(v).mul_(m)


@torch.no_grad()
def egae_bootstrap(values: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """[B] bootstrap value for EGAE: V(s_l) ~ V(s_{l-1}) (value at the last masked-in token) for
    truncated rows, 0 for finished rows and for rows with no masked-in token."""
    B, T = values.shape
    _check("truncated", truncated, (B,))
    mb = mask.bool()
    last = (T - 1) - mb.flip(-1).to(torch.uint8).argmax(-1)
    v_last = values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    ok = truncated.bool() & mb.any(-1)
    return torch.where(ok, v_last, torch.zeros_like(v_last))


@torch.no_grad()
def compute_egae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float = 1.0,
    lam: Lam = 1.0,
    *,
    lam_critic: Lam | None = None,
    turn_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T-PPO extended GAE (docs/algorithms.md §5). Returns (advantages, returns), [B, T] each.

    For a row truncated at generated length l (truncated[b] = True), GAE is cut at the truncation
    point and the next-state value is bootstrapped as V(s_l) ~ V(s_{l-1}):
    A_t = sum_{k=0}^{l-t-1} (gamma*lam)^k delta_{t+k}, delta_{l-1} = r_{l-1} + gamma*V_{l-1} - V_{l-1}.
    Finished rows use standard GAE (V after the last token = 0). `lam_critic` (optional) gives
    decoupled returns (A^{lam_critic} + V); T-PPO trains the value only on finished rows — filter
    truncated rows out of the value loss mask in the caller.
    """
    boot = egae_bootstrap(values, mask, truncated).to(_float_dtype(token_rewards, values))
    if lam_critic is None:
        return compute_gae(token_rewards, values, mask, gamma, lam, bootstrap_values=boot, turn_starts=turn_starts)
    return decoupled_gae(
        token_rewards, values, mask, gamma, lam, lam_critic, bootstrap_values=boot, turn_starts=turn_starts
    )


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_next(t) over masked-in tokens (REINFORCE++ return, docs/algorithms.md §1.7).

    G_next(t) is the return at the next masked-in position (0 after the last one: reset after
    EOS). Rewards at masked positions are ignored; output is 0 there. For right-padded single-turn
    responses this equals verl's REINFORCE++ return.
    """
    B, T = token_rewards.shape
    _check("mask", mask, (B, T))
    dt = _float_dtype(token_rewards)
    m = mask.to(dt)
    a = m * gamma + (1.0 - m)
    return reverse_linear_scan(token_rewards.to(dt) * m, a) * m
