"""Loss aggregation, PPO policy loss, value loss, positive-example NLL, entropy."""

import math

import pytest
import torch

from megarl.algorithms import (
    LOSS_AGGS,
    agg_loss,
    entropy_from_logits,
    policy_loss,
    positive_example_nll,
    value_loss,
    vanilla_pg_loss,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def test_agg_modes_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row empty: never counted
    torch.testing.assert_close(agg_loss(loss, mask, "token-mean"), torch.tensor(7 / 3))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), torch.tensor((1.5 + 4) / 2))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), torch.tensor((3 + 4) / 2))
    # Dr. GRPO: (1/N_seq) sum_i sum_t m*l / L; N_seq = 2 non-empty rows, L = T = 3 or max_len
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), torch.tensor(7 / (2 * 3)))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=7), torch.tensor(7 / (2 * 7)))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm", global_seqs=7, max_len=4),
                               torch.tensor(7 / (7 * 4)))
    torch.testing.assert_close(agg_loss(loss, mask, "token-mean", global_tokens=14), torch.tensor(0.5))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum", global_seqs=7), torch.tensor(1.0))
    assert agg_loss(loss, torch.zeros(3, 3), "token-mean") == 0
    with pytest.raises(KeyError, match="token-mean"):
        agg_loss(loss, mask, "token-avg")
    with pytest.raises(ValueError, match="global_tokens"):
        agg_loss(loss, mask, "token-mean", global_tokens=0)


def _ppo_case():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7, 4.0, math.exp(30.0)]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, -2.5]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # the last token (huge ratio) is padding
    return logp, old, adv, mask


def test_ppo_clip_higher_hand_values_and_metrics():
    logp, old, adv, mask = _ppo_case()
    loss, met = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(-A*rho, -A*clip(rho,.8,1.28)) = -1.28, 0.8, -2.2, -0.7, 4.0
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 - 2.2 - 0.7 + 4.0) / 5))
    torch.testing.assert_close(met["clipfrac_high"], torch.tensor(0.2))
    torch.testing.assert_close(met["clipfrac_low"], torch.tensor(0.2))
    torch.testing.assert_close(met["clipfrac"], torch.tensor(0.4))
    torch.testing.assert_close(met["dual_clip_frac"], torch.tensor(0.0))
    torch.testing.assert_close(met["ratio_mean"], torch.tensor(7.8 / 5))
    torch.testing.assert_close(met["ratio_max"], torch.tensor(4.0))
    torch.testing.assert_close(met["ratio_min"], torch.tensor(0.5))
    log_prod = math.log(1.5 * 0.5 * 1.1 * 0.7 * 4.0)
    torch.testing.assert_close(met["approx_kl_k1"], torch.tensor(-log_prod / 5))
    torch.testing.assert_close(met["approx_kl"], torch.tensor((7.8 - 5 - log_prod) / 5))
    assert met["n_tokens"] == 5
    assert not any(v.requires_grad for v in met.values())
    # gradient: only unclipped tokens (2 and 3) and the A<0 unclipped ratio-4 token carry gradient
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, -2.0 * 1.1, -1.0 * 0.7, 1.0 * 4.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)


def test_ppo_dual_clip_hand_values():
    logp, old, adv, mask = _ppo_case()
    loss, met = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_c=3.0)
    # ratio-4 token with A=-1: min(4, -A*c = 3) = 3
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 - 2.2 - 0.7 + 3.0) / 5))
    torch.testing.assert_close(met["dual_clip_frac"], torch.tensor(0.2))
    loss.backward()
    assert logp.grad[0, 4] == 0  # dual-clipped: constant in rho
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=1.0)


def test_log_ratio_clamp():
    logp = torch.tensor([[30.0, -30.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    _, met = vanilla_pg_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(met["ratio_max"], torch.tensor(math.exp(20.0)))
    torch.testing.assert_close(met["ratio_min"], torch.tensor(math.exp(-20.0)))


def test_vanilla_pg_gradient_is_reinforce_on_policy():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5]])
    loss, _ = vanilla_pg_loss(logp, logp.detach(), adv, torch.tensor([[1, 1, 0]]))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 1.0, 0.0]]) / 2)


def test_policy_loss_empty_mask_is_zero_and_finite_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, met = policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 0.2, 0.2)
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in met.values())
    assert met["ratio_max"] == 1.0


def test_value_loss_hand_values():
    v = torch.tensor([[1.0, 2.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0, 5.0]])
    ret = torch.tensor([[1.2, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, met = value_loss(v, old, ret, mask, clip_eps=0.2)
    # v_clip = [.7, .7, 0]; max((v-R)^2, (v_clip-R)^2) = [.25, 4, 1]
    torch.testing.assert_close(loss, torch.tensor(0.5 * 5.25 / 3))
    torch.testing.assert_close(met["vf_clipfrac"], torch.tensor(1 / 3))
    torch.testing.assert_close(met["vpred_mean"], torch.tensor(1.0))
    loss_nc, _ = value_loss(v, old, ret, mask, clip_eps=None)
    torch.testing.assert_close(loss_nc, torch.tensor(0.5 * (0.04 + 4 + 1) / 3))
    loss.backward()
    # token 0 uses the clipped branch (no grad); token 1: (2-0)/3 ; token 2: (0-1)/3
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 2 / 3, -1 / 3, 0.0]]))


def test_positive_example_nll():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    pos = torch.tensor([True, False, True])
    torch.testing.assert_close(positive_example_nll(logp, mask, pos), torch.tensor(14 / 4))
    torch.testing.assert_close(positive_example_nll(logp, mask, pos, global_tokens=7), torch.tensor(2.0))
    none = positive_example_nll(logp, mask, torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0.0 and none.requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_split_with_global_counts_equals_full_batch(mode):
    torch.manual_seed(0)
    B, T = 9, 12
    mask = (torch.rand(B, T) > 0.4).long()
    mask[4] = 0  # an empty row
    old = -torch.rand(B, T) * 3
    logp0 = old + 0.3 * torch.randn(B, T)
    adv = torch.randn(B, T)
    v0, old_v, ret = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    pos = torch.rand(B) > 0.5
    n_tok = int(mask.sum())
    n_seq = int((mask.sum(-1) > 0).sum())
    n_pos_tok = int((mask * pos.unsqueeze(1)).sum())
    n_pos_seq = int(((mask * pos.unsqueeze(1)).sum(-1) > 0).sum())

    def run(rows, gt, gs, gpt, gps):
        logp = logp0[rows].clone().requires_grad_(True)
        v = v0[rows].clone().requires_grad_(True)
        m = mask[rows]
        pl, _ = policy_loss(logp, old[rows], adv[rows], m, 0.2, 0.28, 3.0, mode, gt, global_seqs=gs, max_len=T)
        vl, _ = value_loss(v, old_v[rows], ret[rows], m, 0.5, mode, gt, global_seqs=gs, max_len=T)
        nl = positive_example_nll(logp, m, pos[rows], mode, gpt, global_seqs=gps, max_len=T)
        (pl + vl + nl).backward()
        return torch.stack([pl, vl, nl]).detach(), logp.grad, v.grad

    full, g_full, gv_full = run(torch.arange(B), None, None, None, None)
    gen = torch.Generator().manual_seed(1)
    splits = [[torch.arange(0, 3), torch.arange(3, 4), torch.arange(4, 9)], [torch.arange(B)]]
    for _ in range(3):  # random micro-batch partitions of shuffled rows, as a packer might produce
        perm = torch.randperm(B, generator=gen)
        cuts = sorted(torch.randperm(B - 1, generator=gen)[:3].add(1).tolist())
        splits.append(list(torch.tensor_split(perm, cuts)))
    for split in splits:
        parts = []
        g, gv = torch.zeros(B, T), torch.zeros(B, T)
        for rows in split:
            out, g_mb, gv_mb = run(rows, n_tok, n_seq, n_pos_tok, n_pos_seq)
            parts.append(out)
            g[rows], gv[rows] = g_mb, gv_mb
        torch.testing.assert_close(sum(parts), full, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g, g_full, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gv, gv_full, rtol=1e-5, atol=1e-7)
    if mode == "token-mean":  # the local per-micro-batch mean is NOT the global value (the pitfall)
        naive = sum(
            policy_loss(logp0[r], old[r], adv[r], mask[r], 0.2, 0.28, 3.0, mode)[0]
            for r in (torch.arange(0, 3), torch.arange(3, 4), torch.arange(4, 9))
        ) / 3
        assert not torch.allclose(naive, full[0])


def test_dr_grpo_hand_values_and_gradient():
    """(1/G) sum_i sum_t l_{i,t} / L with G = 2 responses, L = 4 (the generation budget)."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = vanilla_pg_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-sum-norm", max_len=4)
    # l = -A * rho = -A at rho = 1: row 0 sums to -3, row 1 to +4
    torch.testing.assert_close(loss, torch.tensor((-3.0 + 4.0) / (2 * 4)))
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / (2 * 4))


@pytest.mark.parametrize("mode", MODES)
def test_loss_does_not_scale_with_the_batch(mode):
    """Every mode is a mean over sequences or tokens: duplicating the batch (the global counts
    doubling with it) leaves the loss unchanged, and the gradient of each copy halves."""
    torch.manual_seed(2)
    B, T = 5, 6
    mask = (torch.rand(B, T) > 0.3).long()
    old = -torch.rand(B, T)
    logp0 = old + 0.2 * torch.randn(B, T)
    adv = torch.randn(B, T)

    def run(k):
        logp = logp0.repeat(k, 1).requires_grad_(True)
        m = mask.repeat(k, 1)
        n_tok, n_seq = int(m.sum()), int((m.sum(-1) > 0).sum())
        loss, _ = policy_loss(logp, old.repeat(k, 1), adv.repeat(k, 1), m, 0.2, 0.28, None, mode, n_tok,
                              global_seqs=n_seq, max_len=16)
        loss.backward()
        return loss.detach(), logp.grad

    (l1, g1), (l2, g2) = run(1), run(2)
    torch.testing.assert_close(l2, l1)
    torch.testing.assert_close(g2, torch.cat([g1, g1]) / 2)


def test_dr_grpo_actor_loss_in_the_trainer_has_global_denominators():
    """rl.actor_loss_fn hands this mode N_seq of the whole mini-batch (global_counts over every
    micro-batch and DP rank) and L = rollout.max_new_tokens: micro-batches padded to different
    widths add up to the full-batch loss (sum_{i,t} l / (N_seq * L))."""
    from types import SimpleNamespace

    from megarl.config import load_config
    from megarl.trainer import rl

    cfg = load_config(None, ["algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.policy_loss=vanilla_pg",
                             "rollout.max_new_tokens=10"])
    old = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])

    class MB:  # the two methods of MicroBatch the loss reads, on a width-w slice of rows
        def __init__(self, rows, w):
            self.data = SimpleNamespace(loss_mask=mask[rows, :w], old_logprobs=old[rows, :w],
                                        advantages=adv[rows, :w], ref_logprobs=None, acc=torch.zeros(len(rows)))

        def log_probs(self, logits, temperature):
            return logits

        def entropy(self, logits, temperature):
            return torch.zeros_like(logits)

    batch = SimpleNamespace(acc=torch.zeros(3))
    counts = rl.global_counts(batch, [0, 1, 2], None, mask)
    assert counts["seqs"] == 3
    loss_fn = rl.actor_loss_fn(cfg, counts, 1.0)
    total = loss_fn(MB([0], 3), old[[0], :3])[0] + loss_fn(MB([1, 2], 2), old[[1, 2], :2])[0]
    torch.testing.assert_close(total, torch.tensor((-3.0 + 2.0 - 1.0) / (3 * 10)))


def test_registry_lists_all_modes():
    assert set(MODES) <= set(LOSS_AGGS)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, math.log(3.0)], [1000.0, 1000.0], [0.0, float("-inf")], [-1e4, 3.0]])
    h = entropy_from_logits(logits)
    expected = torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0), 0.0, 0.0])
    torch.testing.assert_close(h, expected)
    torch.manual_seed(0)
    z = torch.randn(4, 5, 33, dtype=torch.float64) * 5
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy_from_logits(z), -(p * p.log()).sum(-1))
    assert entropy_from_logits(z.to(torch.bfloat16)).dtype == torch.float32


def test_value_loss_clipfrac_zero_inside_the_clip_range_float64():
    # old + clamp(v - old) rounds to a value one ulp away from v here; clamping v itself does not
    f = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    v, old, ret = f(0.04757655385024031), f(0.24216704823047347), f(0.024120007262474256)
    loss, met = value_loss(v, old, ret, torch.ones(1, 1, dtype=torch.float64), clip_eps=0.5)
    assert float(met["vf_clipfrac"]) == 0.0
    assert float(loss) == 0.5 * (0.04757655385024031 - 0.024120007262474256) ** 2
