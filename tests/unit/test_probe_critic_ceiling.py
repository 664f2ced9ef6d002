"""tools/probe_critic_ceiling.py: the oracle and the probe against hand-computed values."""

import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "probe_critic_ceiling", Path(__file__).resolve().parents[2] / "tools" / "probe_critic_ceiling.py")
P = importlib.util.module_from_spec(spec)
spec.loader.exec_module(P)


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
