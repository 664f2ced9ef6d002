"""DP balancing and token-budget micro-batches (the packed layout is tested with the trainer's
batch: tests/unit/test_train_model_config.py)."""

import random

import pytest

from megarl.data import balance_across_dp, token_budget_microbatches


def test_balance_across_dp_hand_example():
    # LPT: 10->r0, 9->r1, 8->r1 (17), 7->r0 (17), 1->r0 (tie on load and count: lower rank), 1->r1
    assert balance_across_dp([10, 9, 8, 7, 1, 1], 2) == [[0, 3, 4], [1, 2, 5]]
    assert balance_across_dp([0, 0, 0], 3) == [[0], [1], [2]]
    assert balance_across_dp([5], 2) == [[0], []]
    with pytest.raises(ValueError):
        balance_across_dp([1, -2], 2)


def test_balance_across_dp_properties():
    rng = random.Random(0)
    for _ in range(20):
        n, dp = rng.randint(1, 40), rng.randint(1, 8)
        lengths = [rng.randint(0, 100) for _ in range(n)]
        groups = balance_across_dp(lengths, dp)
        assert sorted(i for g in groups for i in g) == list(range(n))
        if n >= dp:
            assert all(groups)
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert max(loads) - min(loads) <= max(lengths)  # LPT bound
        assert groups == balance_across_dp(lengths, dp)


def test_token_budget_microbatches_ffd_hand_example():
    # sorted: 9(i5) 6(i4) 5(i0) 4(i2) 3(i1) 2(i3); bins: {9}, {6,4}, {5,3,2}
    mb = token_budget_microbatches([5, 3, 4, 2, 6, 9], 10)
    assert mb == [[5], [2, 4], [0, 1, 3]] and mb.oversized == []
    mb = token_budget_microbatches([12, 3, 4], 10)
    assert mb == [[0], [1, 2]] and mb.oversized == [0]


def test_token_budget_microbatches_respects_budget():
    rng = random.Random(1)
    lengths = [rng.randint(1, 50) for _ in range(60)]
    mb = token_budget_microbatches(lengths, 64)
    assert sorted(i for b in mb for i in b) == list(range(60))
    assert all(sum(lengths[i] for i in b) <= 64 for b in mb)
    assert len(mb) <= 2 * -(-sum(lengths) // 64)  # FFD never needs more than twice the lower bound


def test_balance_keeps_samples_home_within_the_lpt_load():
    """`home`: rows stay where their data is unless that would load a group beyond LPT's largest
    group (megarl.trainer.rows: a row is trained where it was generated when it can be)."""
    import random

    from megarl.data.packing import balance_across_dp

    # balanced homes: every sample stays home
    assert balance_across_dp([5, 5, 5, 5], 2, home=[1, 0, 1, 0]) == [[1, 3], [0, 2]]
    # every sample at home 0: LPT's load caps group 0 and the rest moves
    groups = balance_across_dp([4, 4, 4, 4], 2, home=[0, 0, 0, 0])
    assert [sum(4 for _ in g) for g in groups] == [8, 8] and len(groups[0]) == 2
    rng = random.Random(0)
    stayed = total = 0
    for _ in range(200):
        n, dp = rng.randint(1, 40), rng.randint(1, 8)
        lengths = [rng.randint(1, 500) for _ in range(n)]
        home = [rng.randrange(dp) for _ in range(n)]
        lpt = max(sum(lengths[i] for i in g) for g in balance_across_dp(lengths, dp))
        groups = balance_across_dp(lengths, dp, home)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert max(sum(lengths[i] for i in g) for g in groups) <= lpt + max(lengths)
        stayed += sum(home[i] == r for r, g in enumerate(groups) for i in g)
        total += n
    assert stayed / total > 0.6
    with pytest.raises(ValueError, match="home"):
        balance_across_dp([1, 2], 2, home=[0, 2])
