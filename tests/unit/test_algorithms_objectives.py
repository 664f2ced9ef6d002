"""GSPO, GSPO-token, CISPO, SAPO, Clip-Cov, KL-Cov, GMPO, GPG losses and the ReMax / OPO / GPG
estimators against hand-computed values and gradients; ragged masks and empty responses;
ReMax's greedy baseline sample in the rollout; the config wiring of their parameters."""

import math

import pytest
import torch

from megarl.algorithms import ADVANTAGES, POLICY_LOSSES, AdvantageInputs, AdvantageParams
from megarl.algorithms.objectives import CONFIG_KWARGS, gpg_advantages, opo_advantages, token_covariance

D = torch.float64
NEW_LOSSES = ["gspo", "gspo_token", "cispo", "sapo", "clip_cov", "kl_cov", "gmpo", "gpg"]


def t(x):
    return torch.tensor(x, dtype=D)


def leaf(x):
    return torch.tensor(x, dtype=D, requires_grad=True)


def close(a, b, **kw):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), **kw)


# rows: 3 tokens, 1 token (ragged), empty response
OLD = t([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
LOGP = [[-0.9, -1.2, -0.6], [-1.3, 0.0, 0.0], [0.0, 0.0, 0.0]]  # log-ratios [.1, -.2, .4], [-.3]
MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
ADV = t([[1.0, 1.0, 1.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ---- GSPO -------------------------------------------------------------------------------------------
def test_gspo_unclipped_value_and_gradient():
    logp = leaf(LOGP)
    loss, met = POLICY_LOSSES["gspo"](logp, OLD, ADV, MASK, 0.2, 0.2, None, eps_low=0.9, eps_high=9.0)
    s0, s1 = math.exp(0.1), math.exp(-0.3)  # exp(mean log-ratio) per row
    close(loss, (-1.0 * s0 + 0.5 * s1) / 2)  # seq-mean-token-mean over the 2 non-empty rows
    loss.backward()
    # d/dlogp_t of -A s_i / N_seq = -A s_i / |y_i| / N_seq
    close(logp.grad, [[-s0 / 6] * 3, [0.5 * s1 / 2, 0, 0], [0, 0, 0]])
    close(met["n_tokens"], 4.0)
    close(met["clipfrac"], 0.0)


def test_gspo_paper_clip_range_clips_both_sides():
    logp = leaf(LOGP)
    loss, met = POLICY_LOSSES["gspo"](logp, OLD, ADV, MASK, 0.2, 0.2, None)  # defaults 3e-4 / 4e-4
    close(loss, (-1.0 * (1 + 4e-4) + 0.5 * (1 - 3e-4)) / 2)
    loss.backward()
    close(logp.grad, torch.zeros(3, 3, dtype=D))  # both sequences clipped: no gradient
    close(met["clipfrac_high"], 3 / 4)  # token-weighted: row 0's 3 tokens
    close(met["clipfrac_low"], 1 / 4)


def test_gspo_ignores_agg_and_uses_global_seqs():
    a, _ = POLICY_LOSSES["gspo"](t(LOGP), OLD, ADV, MASK, eps_low=0.9, eps_high=9.0, agg="token-mean")
    b, _ = POLICY_LOSSES["gspo"](t(LOGP), OLD, ADV, MASK, eps_low=0.9, eps_high=9.0, global_seqs=4)
    close(b, a * 2 / 4)


def test_gspo_token_equals_gspo_in_value_and_gradient_for_sequence_advantages():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g, dtype=D)
    new = old + 0.05 * torch.randn(4, 6, generator=g, dtype=D)
    mask = t([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0] * 6])
    adv = t([1.5, -0.7, 0.3, 2.0]).unsqueeze(-1).expand(4, 6) * mask
    grads, vals = [], []
    for name in ("gspo", "gspo_token"):
        lp = new.clone().requires_grad_(True)
        loss, met = POLICY_LOSSES[name](lp, old, adv, mask, eps_low=0.02, eps_high=0.03)
        loss.backward()
        vals.append((loss.detach(), met["clipfrac"]))
        grads.append(lp.grad)
    close(vals[0][0], vals[1][0])
    close(vals[0][1], vals[1][1])
    close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_gspo_token_lets_per_token_advantages_through():
    logp = leaf(LOGP)
    adv = t([[1.0, -2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, _ = POLICY_LOSSES["gspo_token"](logp, OLD, adv, MASK, eps_low=0.9, eps_high=9.0)
    s0 = math.exp(0.1)
    close(loss, (-s0 * (1 - 2 + 3) / 3 + 0.0) / 2)
    loss.backward()
    close(logp.grad[0], [-1.0 * s0 / 3 / 2, 2.0 * s0 / 3 / 2, -3.0 * s0 / 3 / 2])  # -A_t s_i / |y| / N_seq


# ---- CISPO ------------------------------------------------------------------------------------------
def test_cispo_values_and_gradient_on_clipped_tokens():
    logp = leaf([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = t([[-1.5, -2.0, -2.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])  # ratios e^.5, 1, e^-1 ; 1
    adv = t([[1.0, -1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, met = POLICY_LOSSES["cispo"](logp, old, adv, MASK, 0.2, 0.2, None, eps_high=0.2)  # no lower bound
    w = [1.2, 1.0, math.exp(-1.0), 1.0]
    terms = [-w[0] * 1.0 * -1.0, -w[1] * -1.0 * -2.0, -w[2] * 2.0 * -3.0, -w[3] * 3.0 * -0.5]
    close(loss, sum(terms) / 4)  # token-mean
    loss.backward()
    # every token keeps its gradient -w A / N, the clipped one (ratio e^.5 -> 1.2) included
    close(logp.grad, [[-1.2 / 4, 1.0 / 4, -2 * math.exp(-1) / 4], [-3.0 / 4, 0, 0], [0, 0, 0]])
    close(met["clipfrac_high"], 1 / 4)
    close(met["clipfrac_low"], 0.0)
    logp2 = leaf(logp.detach().tolist())
    loss2, met2 = POLICY_LOSSES["cispo"](logp2, old, adv, MASK, eps_low=0.2, eps_high=0.2)
    loss2.backward()
    close(logp2.grad[0, 2], -0.8 * 2 / 4)  # weight clipped at 1 - 0.2, gradient still there
    close(met2["clipfrac_low"], 1 / 4)


# ---- SAPO -------------------------------------------------------------------------------------------
def test_sapo_soft_gate_values_and_gradient():
    logp = leaf(LOGP)
    loss, met = POLICY_LOSSES["sapo"](logp, OLD, ADV, MASK, tau_pos=1.0, tau_neg=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    r0 = [math.exp(x) for x in (0.1, -0.2, 0.4)]
    r1 = math.exp(-0.3)
    f0 = [sig(1.0 * (r - 1)) * 4 / 1.0 for r in r0]  # A > 0: tau_pos
    f1 = sig(2.0 * (r1 - 1)) * 4 / 2.0  # A < 0: tau_neg
    close(loss, (-sum(f0) / 3 + 0.5 * f1) / 2)
    loss.backward()
    # d f / d logp = 4 sig (1 - sig) r
    d0 = [4 * sig(r - 1) * (1 - sig(r - 1)) * r for r in r0]
    d1 = 4 * sig(2 * (r1 - 1)) * (1 - sig(2 * (r1 - 1))) * r1
    close(logp.grad, [[-d / 3 / 2 for d in d0], [0.5 * d1 / 2, 0, 0], [0, 0, 0]])
    close(met["gate_mean"], (sum(f0) + f1) / 4)


def test_sapo_on_policy_gradient_is_plain_policy_gradient():
    lp = leaf([[-1.0, -2.0]])
    loss, _ = POLICY_LOSSES["sapo"](lp, lp.detach().clone(), t([[2.0, -3.0]]), t([[1, 1]]))
    loss.backward()
    close(lp.grad, [[-2.0 / 2, 3.0 / 2]])  # f'(1) = 1 for any tau


# ---- Clip-Cov / KL-Cov -----------------------------------------------------------------------------
CLP = [[-0.1, -3.0, -0.2, -0.3], [0.0, 0.0, 0.0, 0.0]]
COLD = t([[-0.2, -2.9, -0.2, -0.4], [0.0, 0.0, 0.0, 0.0]])
CADV = t([[2.0, -2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
CMASK = t([[1, 1, 1, 1], [0, 0, 0, 0]])  # second row: empty response


def test_token_covariance_over_masked_tokens():
    cov = token_covariance(t(CLP), CADV, CMASK)  # mean logp -0.9, mean A 0
    close(cov[0], [0.8 * 2.0, -2.1 * -2.0, 0.0, 0.0], atol=1e-12, rtol=0)
    assert torch.isinf(cov[1]).all()


def _vanilla_grad(logp, old, adv, n):
    return -adv * torch.exp(logp - old) / n


def test_clip_cov_detached_tokens_get_zero_gradient_and_keep_their_value():
    logp = leaf(CLP)
    loss, met = POLICY_LOSSES["clip_cov"](logp, COLD, CADV, CMASK, ratio=2e-4, lb=1.0, ub=4.0)
    rho = torch.exp(t(CLP) - COLD)
    close(loss, (-(CADV * rho) * CMASK).sum() / 4)  # value unchanged by the detach
    loss.backward()
    expect = _vanilla_grad(t(CLP), COLD, CADV, 4) * CMASK
    expect[0, 0] = 0.0  # the only token with 1 < Cov < 4 (Cov = 1.6); k = max(1, 2e-4 * 4) = 1
    close(logp.grad, expect)
    close(met["cov_detached_frac"], 1 / 4)
    # ratio 1 -> k = 4, but only the 2 tokens with Cov in (1, 5) are candidates: both detached
    logp2 = leaf(CLP)
    loss2, met2 = POLICY_LOSSES["clip_cov"](logp2, COLD, CADV, CMASK, ratio=1.0, lb=1.0, ub=5.0)
    loss2.backward()
    assert logp2.grad[0, 0] == 0 and logp2.grad[0, 1] == 0
    close(met2["cov_detached_frac"], 2 / 4)


def test_clip_cov_random_draw_among_candidates_uses_the_generator():
    picks = set()
    for seed in range(12):
        lp = leaf(CLP)
        loss, _ = POLICY_LOSSES["clip_cov"](lp, COLD, CADV, CMASK, ratio=0.25, lb=1.0, ub=5.0,
                                            generator=torch.Generator().manual_seed(seed))
        loss.backward()
        zero = [j for j in range(4) if lp.grad[0, j] == 0 and CADV[0, j] != 0]
        assert len(zero) == 1
        picks.add(zero[0])
    assert picks == {0, 1}


def test_kl_cov_penalises_top_covariance_tokens():
    logp = leaf(CLP)
    loss, met = POLICY_LOSSES["kl_cov"](logp, COLD, CADV, CMASK, ratio=2e-4, kl_coef=1.0)
    rho = torch.exp(t(CLP) - COLD)
    base = (-(CADV * rho) * CMASK).sum()
    close(loss, (base + 1.0 * abs(-3.0 - -2.9)) / 4)  # token 1 has the largest Cov (4.2)
    loss.backward()
    expect = _vanilla_grad(t(CLP), COLD, CADV, 4) * CMASK
    expect[0, 1] += -1.0 / 4  # d|logp - old| = sign(-0.1) = -1
    close(logp.grad, expect)
    close(met["kl_cov_frac"], 1 / 4)
    close(met["kl_cov_abs_kl"], (0.1 + 0.1 + 0.0 + 0.1) / 4)


def test_cov_losses_with_only_empty_rows_are_zero():
    for name in ("clip_cov", "kl_cov"):
        lp = leaf([[0.5, 0.1]])
        loss, met = POLICY_LOSSES[name](lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[0, 0]]))
        loss.backward()
        assert float(loss.detach()) == 0.0 and lp.grad.abs().sum() == 0
        assert all(torch.isfinite(v) for v in met.values())


# ---- GMPO -------------------------------------------------------------------------------------------
def test_gmpo_log_space_clip_geometric_mean_value_and_gradient():
    old = t([[-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0]])
    logp = leaf([[-0.4, -1.1], [-1.6, -0.9], [0.0, 0.0]])  # x = [.6, -.1], [-.6, .1]
    adv = t([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]])
    mask = t([[1, 1], [1, 1], [0, 0]])
    loss, met = POLICY_LOSSES["gmpo"](logp, old, adv, mask, eps_low=0.4, eps_high=0.4)
    # A > 0: min(x, clip(x)) = [.4, -.1]; A < 0: max(x, clip(x)) = [-.4, .1]
    R0, R1 = math.exp(0.15), math.exp(-0.15)
    close(loss, (-R0 + R1) / 2)
    loss.backward()
    close(logp.grad, [[0.0, -R0 / 2 / 2], [0.0, R1 / 2 / 2], [0.0, 0.0]])  # clipped tokens: no gradient
    close(met["clipfrac_high"], 1 / 4)
    close(met["clipfrac_low"], 1 / 4)
    loss_g, _ = POLICY_LOSSES["gmpo"](logp.detach(), old, adv, mask, eps_low=0.4, eps_high=0.4, global_seqs=4)
    close(loss_g, (-R0 + R1) / 4)


def test_gmpo_micro_batches_of_whole_rows_add_up_to_the_full_batch():
    """R_i is a per-row geometric mean: split by rows (micro-batches of different widths, as the
    packer cuts them) with the global N_seq, the losses and gradients add up to the full batch's."""
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 7, generator=g, dtype=D)
    new = old + 0.5 * torch.randn(6, 7, generator=g, dtype=D)  # some tokens beyond +-0.4: clipped
    adv = torch.randn(6, 1, generator=g, dtype=D).expand(6, 7)
    mask = t([[1] * 7, [1] * 3 + [0] * 4, [0] * 7, [1] * 5 + [0] * 2, [1] * 2 + [0] * 5, [1] * 6 + [0]])
    full_lp = new.clone().requires_grad_(True)
    full, _ = POLICY_LOSSES["gmpo"](full_lp, old, adv, mask)
    full.backward()
    total, grad = 0.0, torch.zeros_like(new)
    for rows, w in (([0, 5], 7), ([1, 2, 4], 3), ([3], 5)):
        lp = new[rows, :w].clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES["gmpo"](lp, old[rows, :w], adv[rows, :w], mask[rows, :w], global_seqs=5)
        loss.backward()
        total, grad[rows, :w] = total + loss.detach(), lp.grad
    close(total, full.detach())
    close(grad, full_lp.grad)


# ---- GPG --------------------------------------------------------------------------------------------
def test_gpg_loss_is_plain_policy_gradient():
    logp = leaf(LOGP)
    loss, met = POLICY_LOSSES["gpg"](logp, OLD, ADV, MASK)
    close(loss, (-(-0.9 - 1.2 - 0.6) * 1.0 + 0.5 * -1.3) / 4)
    loss.backward()
    close(logp.grad, -ADV * MASK / 4)
    loss_s, _ = POLICY_LOSSES["gpg"](t(LOGP), OLD, ADV, MASK, agg="seq-mean-token-sum")
    close(loss_s, (2.7 - 0.65) / 2)


# ---- all new losses: empty / ragged, uniform call --------------------------------------------------
@pytest.mark.parametrize("name", NEW_LOSSES)
def test_uniform_call_and_all_empty_rows(name):
    lp = leaf([[0.3, -0.2], [0.1, 0.0]])
    loss, met = POLICY_LOSSES[name](lp, t([[0.0, 0.0], [0.0, 0.0]]), t([[1.0, -1.0], [2.0, 2.0]]), t([[0, 0], [0, 0]]),
                                    0.2, 0.2, None, agg="token-mean", global_tokens=None, global_seqs=None, max_len=2)
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp.grad.abs().sum() == 0
    assert all(torch.isfinite(v) for v in met.values())
    assert float(met["n_tokens"]) == 0.0


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_masked_out_tokens_never_matter(name):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 5, generator=g, dtype=D)
    new = old + 0.1 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.randn(3, 5, generator=g, dtype=D)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    kw = lambda: {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}  # noqa: E731
    lp = new.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES[name](lp, old, adv, mask, **kw())
    loss.backward()
    assert (lp.grad * (1 - mask)).abs().sum() == 0
    junk = torch.where(mask.bool(), new, t(5.0))  # garbage in padded positions
    lp2 = junk.clone().requires_grad_(True)
    adv2 = torch.where(mask.bool(), adv, t(-7.0))
    loss2, _ = POLICY_LOSSES[name](lp2, old, adv2, mask, **kw())
    close(loss2, loss)


def test_every_new_loss_is_configured():
    assert set(CONFIG_KWARGS) == set(NEW_LOSSES)


# ---- estimators -------------------------------------------------------------------------------------
def _inputs(scores, lengths, uid, baseline=None):
    T = max(lengths + [1])
    mask = torch.zeros(len(scores), T, dtype=torch.float32)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    rewards = torch.zeros_like(mask)
    for i, L in enumerate(lengths):
        if L:
            rewards[i, L - 1] = scores[i]
    return AdvantageInputs(token_rewards=rewards, mask=mask, group_index=uid,
                           baseline_scores=None if baseline is None else torch.tensor(baseline))


def test_remax_subtracts_the_greedy_baseline():
    inp = _inputs([1.0, 0.0, 1.0], [2, 3, 1], ["a", "a", "b"], baseline=[0.5, 0.5, 1.0])
    adv, ret = ADVANTAGES["remax"](inp, AdvantageParams())
    close(adv, [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    assert ret is adv
    with pytest.raises(ValueError, match="baseline_scores"):
        ADVANTAGES["remax"](_inputs([1.0], [1], ["a"]), AdvantageParams())


def test_opo_length_weighted_baseline():
    # group a: lengths 2, 4, scores 1, 0 -> b = (2*1 + 4*0) / 6; group b of size 1 -> b = 0
    close(opo_advantages(t([1.0, 0.0, 3.0]), t([2, 4, 5]), ["a", "a", "b"]), [1 - 1 / 3, -1 / 3, 3.0])
    # an empty response has weight 0 in its group's baseline; a group of empty responses has b = 0
    close(opo_advantages(t([0.0, 1.0, 0.0, 0.0]), t([0, 3, 0, 0]), ["a", "a", "b", "b"]), [-1.0, 0.0, 0.0, 0.0])
    adv, _ = ADVANTAGES["opo"](_inputs([1.0, 0.0, 3.0], [2, 4, 5], ["a", "a", "b"]), AdvantageParams())
    close(adv[0], [2 / 3, 2 / 3, 0, 0, 0])
    close(adv[1], [-1 / 3] * 4 + [0])
    close(adv[2], [3.0] * 5)


def test_gpg_alpha_correction_and_std_option():
    s, uid = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), ["a", "a", "b", "b", "c", "c", "d", "d"]
    # groups a, d valid; b, c all-equal (invalid): B = 8, M = 4, alpha = 2
    close(gpg_advantages(s, uid), [1.0, -1.0, 0, 0, 0, 0, 1.0, -1.0])
    close(gpg_advantages(s, uid, alpha_correction=False), [0.5, -0.5, 0, 0, 0, 0, 0.5, -0.5])
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    a = 2 * 0.5 / (std + 1e-6)
    close(gpg_advantages(s, uid, norm_by_std=True, eps=1e-6), [a, -a, 0, 0, 0, 0, a, -a])
    close(gpg_advantages(t([1.0, 1.0]), ["a", "a"]), [0.0, 0.0])  # all invalid: alpha = 1, A = 0
    adv, _ = ADVANTAGES["gpg"](_inputs([1.0, 0.0, 1.0, 1.0], [1, 2, 1, 1], ["a", "a", "b", "b"]),
                               AdvantageParams(gpg_alpha=True, gpg_norm_by_std=False))
    close(adv, [[1.0, 0.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])


# ---- ReMax rollout: one greedy sample per prompt, never in the batch --------------------------------
class RecordingWorker:
    """Scripted worker: sampled responses score 1 for the first half of the group, the greedy one 0.25*p."""

    def __init__(self):
        self.calls, self.metrics = [], {}

    def generate(self, items, encoded, sampling):
        from megarl.trainer.batch import Trajectory

        self.calls.append((list(items), sampling.n, sampling.temperature, sampling.fire))
        out = []
        for uid in items:
            for k in range(sampling.n):
                greedy = sampling.temperature == 0
                score = 0.25 * int(uid[1:]) if greedy else float(k < sampling.n // 2)
                out.append(Trajectory(uid=uid, prompt_ids=[1], response_ids=[2] * (k + 1),
                                      rollout_logprobs=[0.0] * (k + 1), finish_reason="greedy" if greedy else "stop",
                                      score=score, acc=score > 0.5))
        self.metrics = {"reward/count": float(len(out))}
        return out


def _collect(overrides):
    from megarl.config import load_config
    from megarl.trainer.step_collector import collect_step_batch

    cfg = load_config("configs/algorithms/grpo.yaml", ["rollout.n_samples_per_prompt=4", "rollout.prompts_per_step=3",
                                                       "algorithm.mini_batch_size=4", "rollout.fire=true", *overrides])
    stream = iter(f"p{i}" for i in range(100))
    worker = RecordingWorker()
    batch, m = collect_step_batch(lambda n: [next(stream) for _ in range(n)], lambda items: [[0]] * len(items),
                                  worker, cfg, 0, [])
    return cfg, worker, batch, m


def test_remax_rollout_generates_one_greedy_sample_per_prompt_outside_the_batch():
    from megarl.trainer.batch import StepBatch

    cfg, worker, batch, m = _collect(["algorithm.advantage=remax"])
    assert [(c[1], c[2], c[3]) for c in worker.calls] == [(4, cfg.rollout.temperature, True), (1, 0.0, False)]
    assert worker.calls[0][0] == worker.calls[1][0] == ["p0", "p1", "p2"]
    assert len(batch) == 3 * 4 and all(t.finish_reason == "stop" for t in batch)  # greedy samples not trained on
    assert [t.baseline_score for t in batch] == [0.25 * (i // 4) for i in range(12)]
    assert m["reward/count"] == 12.0  # reward metrics of the sampled responses only
    close(m["reward/greedy_baseline_mean"], 0.25)
    sb = StepBatch.from_trajectories(batch)
    close(sb.baseline_score, [0.25 * (i // 4) for i in range(12)])
    close(sb.select([5, 0]).baseline_score, [0.25, 0.0])


def test_remax_rollout_with_dynamic_sampling_and_other_estimators_unchanged():
    _, worker, batch, _ = _collect(["algorithm.advantage=remax", "algorithm.dynamic_sampling=true"])
    assert [c[1] for c in worker.calls] == [4, 1] and all(t.baseline_score is not None for t in batch)
    _, worker, batch, m = _collect(["algorithm.advantage=grpo"])
    assert len(worker.calls) == 1 and all(t.baseline_score is None for t in batch)
    assert "reward/greedy_baseline_mean" not in m


def test_remax_advantages_in_the_trainer_use_the_greedy_baseline():
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch

    cfg, _, trajs, _ = _collect(["algorithm.advantage=remax"])
    batch = StepBatch.from_trajectories(trajs)
    rl.set_masks(batch, cfg)
    local = batch.select(list(range(len(batch))))
    rl.compute_advantages(batch, local, list(range(len(batch))), cfg, None, 0.0)
    expect = (batch.score - batch.baseline_score).unsqueeze(-1) * batch.response_mask
    torch.testing.assert_close(local.advantages, expect)


# ---- config wiring ----------------------------------------------------------------------------------
def test_objective_kwargs_come_from_the_typed_config():
    from megarl.config import load_config
    from megarl.trainer.rl import objective_kwargs

    base = "configs/algorithms/grpo.yaml"
    assert objective_kwargs(load_config(base, ["algorithm.policy_loss=ppo"])) == {}
    assert objective_kwargs(load_config(base, ["algorithm.policy_loss=gspo"])) == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert objective_kwargs(load_config(base, ["algorithm.policy_loss=sapo", "algorithm.sapo_tau_neg=2.0"])) == {
        "tau_pos": 1.0, "tau_neg": 2.0}
    assert objective_kwargs(load_config(base, ["algorithm.policy_loss=cispo"])) == {"eps_low": None, "eps_high": 0.2}
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError, match="algorithm.clip_cov_ub"):
        load_config(base, ["algorithm.clip_cov_lb=5.0", "algorithm.clip_cov_ub=1.0"])
    with pytest.raises(ConfigError, match="algorithm.sapo_tau_pos"):
        load_config(base, ["algorithm.sapo_tau_pos=0"])


def test_gpg_alpha_field_is_live_in_the_trainer():
    """algorithm.gpg_alpha through rl.compute_advantages (the liveness script's fixed batch has no
    all-equal group, where alpha differs from 1)."""
    from megarl.config import load_config
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch, Trajectory

    trajs = [Trajectory(uid=u, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[0.0, 0.0], finish_reason="stop",
                        score=s) for u, s in [("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0)]]
    out = {}
    for alpha in ("true", "false"):
        cfg = load_config("configs/algorithms/grpo.yaml", ["algorithm.advantage=gpg", f"algorithm.gpg_alpha={alpha}",
                                                           "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=2",
                                                           "algorithm.mini_batch_size=4"])
        batch = StepBatch.from_trajectories(trajs)
        rl.set_masks(batch, cfg)
        local = batch.select([0, 1, 2, 3])
        rl.compute_advantages(batch, local, [0, 1, 2, 3], cfg, None, 0.0)
        out[alpha] = local.advantages[:, 0].tolist()
    assert out == {"true": [1.0, -1.0, 0.0, 0.0], "false": [0.5, -0.5, 0.0, 0.0]}
