"""tools/research/probe_critic_ceiling.py: the oracle and the probe against hand-computed values."""

import pytest
import torch

from tools.research import probe_critic_ceiling as P


def test_first_departure():
    assert P.first_departure("1+2=3 3", "1+2=3 3") == 7
    assert P.first_departure("1+2=4 4", "1+2=3 3") == 4
    assert P.first_departure("1+2", "1+2=3") == 3


def test_oracle_values_by_hand():
    # a right sample (4 tokens) and a wrong one whose 2nd character departs (visible from token 2 on)
    r, v, after = P.oracle_values([("abcd", "abcd", 1.0, 4), ("axcd", "abcd", -1.0, 4)])
    assert r.tolist() == [1, 1, 1, 1, -1, -1, -1, -1]
    c = (4 * 1 + 2 * -1) / 6  # mean return of the tokens with no visible departure
    assert v.tolist() == pytest.approx([c] * 6 + [-1, -1])
    assert after == pytest.approx(2 / 8)
    # EV = 1 - Var(R - V) / Var(R), sample variances
    d = r - v
    assert P.explained_variance(r, v) == pytest.approx(1 - float(d.var() / r.var()))


def test_ridge_probe_reads_a_linear_signal_and_not_noise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, generator=g, dtype=torch.float64)
    held = torch.arange(400) % 5 == 0
    y = 2 * x[:, 0] - x[:, 2] + 0.01 * torch.randn(400, generator=g, dtype=torch.float64)
    assert P.ridge_probe(x, y, held)[1] > 0.99
    noise = torch.randn(400, generator=g, dtype=torch.float64)
    assert P.ridge_probe(x, noise, held)[1] < 0.05


def test_oracle_values_by_position_by_hand():
    # positions 0-1 are error-free in both samples (mean return 0); 2-3 only in the right one (1)
    r, v, _ = P.oracle_values([("abcd", "abcd", 1.0, 4), ("axcd", "abcd", -1.0, 4)], by_position=True)
    assert v.tolist() == pytest.approx([0, 0, 1, 1, 0, 0, -1, -1])
    assert P.explained_variance(r, v) > P.explained_variance(r, P.oracle_values(
        [("abcd", "abcd", 1.0, 4), ("axcd", "abcd", -1.0, 4)])[1])


def test_fit_critic_learns_a_return_decided_by_the_first_response_token(tmp_path):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(tmp_path, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=0))
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(200):
        first = int(torch.randint(10, 20, (1,), generator=g))
        rest = torch.randint(30, 60, (5,), generator=g).tolist()
        seqs.append(([1, 2, 3], [first, *rest], 1.0 if first < 15 else -1.0))
    log = P.fit_critic(P.load_critic(str(tmp_path)), seqs, [i % 5 == 0 for i in range(200)], steps=150, lr=3e-3,
                       batch=32, report_every=150)
    # tokens 1-5 (5 of 6) see the deciding token: EV ~ 5/6 for a perfect fit
    assert log[-1]["heldout_ev"] > 0.6


def test_fit_critic_regresses_to_given_token_targets(tmp_path):
    """With token_targets the critic fits those (a visible-marker detector), and reports its EV
    against them as well as against the returns."""
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    save_tiny_model(tmp_path, TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=0))
    g = torch.Generator().manual_seed(1)
    seqs, targets = [], []
    for i in range(200):
        resp = torch.randint(30, 60, (6,), generator=g).tolist()
        bad = int(torch.randint(0, 2, (1,), generator=g))
        at = int(torch.randint(0, 5, (1,), generator=g))
        if bad:
            resp[at] = 7  # the "error" token, visible to every later position
        seqs.append(([1, 2, 3], resp, -1.0 if bad else 1.0))
        targets.append([-1.0 if bad and t > at else 0.0 for t in range(6)])
    log = P.fit_critic(P.load_critic(str(tmp_path)), seqs, [i % 5 == 0 for i in range(200)], steps=200, lr=3e-3,
                       batch=32, report_every=200, token_targets=targets)
    assert log[-1]["heldout_target_ev"] > 0.8
    assert log[-1]["heldout_ev"] < log[-1]["heldout_target_ev"]  # the returns also vary before the marker


def test_true_value_ev_corrects_the_monte_carlo_noise():
    # returns R ~ +1 w.p. p(s), -1 else, with p known: the true value V*(s) = 2p - 1 and the ceiling
    # EV* = Var(V*) / Var(R). K = 4 continuations estimate V* with noise that a plain EV would
    # count against it; true_value_ev removes it.
    g = torch.Generator().manual_seed(0)
    n, k = 200_000, 4
    p = torch.rand(n, generator=g, dtype=torch.float64)
    v_star = 2 * p - 1
    draw = lambda *shape: torch.where(torch.rand(*shape, generator=g, dtype=torch.float64) < p.view(-1, *[1] * (len(shape) - 1)), 1.0, -1.0)
    r = draw(n)
    conts = draw(n, k)
    ceiling = float(v_star.var() / (v_star.var() + (1 - v_star ** 2).mean()))  # Var(E[R|s]) / Var(R)
    assert ceiling == pytest.approx(1 / 3 / (1 / 3 + 2 / 3), abs=0.01)  # p ~ U(0,1): Var(V*) = 1/3, E[1 - V*^2] = 2/3
    naive = P.explained_variance(r, conts.mean(1))
    est = P.true_value_ev(r, conts.mean(1), conts.var(1) / k)
    assert est == pytest.approx(ceiling, abs=0.01)
    assert naive < ceiling - 0.1  # the uncorrected estimate is well below the ceiling
    # a constant value explains nothing: V^ = mean return, no noise
    assert P.true_value_ev(r, torch.full_like(r, float(r.mean())), torch.zeros(n, dtype=torch.float64)) == pytest.approx(0.0, abs=1e-9)


def test_score_reads_the_last_line():
    assert P.score("1+2=3 3\nAnswer: 3", 3) == 1.0
    assert P.score("Answer: 3\n", 3) == 1.0
    assert P.score("Answer: 3\nAnswer: 4", 3) == -1.0
    assert P.score("", 3) == -1.0


def test_true_values_need_two_continuations():
    with pytest.raises(ValueError, match="--mc-continuations must be >= 2"):
        P.mc_true_values(None, None, [], [], [], k=1, stride=1, temperature=1.0, seed=0)


def test_noisy_cot_is_the_reference_without_noise_and_propagates_its_errors():
    import random

    from megarl.tasks.arith import cot_response

    rng = random.Random(0)
    assert P.noisy_cot(347, 85, 0.0, rng) == cot_response(347, 85)
    for _ in range(50):
        lines = P.noisy_cot(958, 467, 1.0, rng).split("\n")
        # every operand digit misread
        assert all(ln[0] != ref for ln, ref in zip(lines, "859")) and all(ln[2] != ref for ln, ref in zip(lines, "764"))
        for prev, cur in zip(lines[:2], lines[1:3]):  # the carry is the written sum's tens digit
            assert int(cur.split("=")[0].split("+")[2]) == int(prev.split("=")[1].split(" ")[0]) // 10


def test_prm_token_targets_by_hand():
    # the departure is at character 2; the state before token t sees characters < t: tokens 3+ see it
    assert P.prm_token_targets("4+9", "4+8", -1.0, 5) == [1.0, 1.0, 1.0, -1.0, -1.0]
    assert P.prm_token_targets("4+8", "4+8", 1.0, 4) == [1.0] * 4


def test_prm_problems_name_a_bad_row(tmp_path):
    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"problem": "12+34"}\n{"question": "1+2"}\n')
    with pytest.raises(SystemExit, match=r"sft.jsonl:2: not an arith row"):
        P.fit_prm(None, None, str(rows), 0.03, steps=1, lr=1e-3, seed=0)
