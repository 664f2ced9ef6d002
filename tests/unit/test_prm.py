"""Code PRM pure parts (megarl.algorithms.prm): binary-search labels, line ends, PRM targets, dense
line rewards and their placement in the trainer's token rewards; the code_lines task's rows."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import prm as P


def oracle(first_bad: int):
    """prefix_passes(j) of a response whose first unrecoverable line is `first_bad`, counting calls."""
    calls = []

    def passes(j: int) -> bool:
        calls.append(j)
        return j < first_bad

    return passes, calls


@pytest.mark.parametrize("n, first_bad, labels, queried", [
    (5, 3, [1, 1, 0, 0, 0], [3, 2]),       # mid 3 fails -> hi 3; mid 2 passes -> lo 3
    (5, 5, [1, 1, 1, 1, 0], [3, 4]),       # every earlier prefix recovers: only the last line is 0
    (5, 1, [0, 0, 0, 0, 0], [3, 2, 1]),    # the first line is already unrecoverable
    (1, 1, [0], []),                       # one line: the failing response itself, no oracle call
    (8, 6, [1, 1, 1, 1, 1, 0, 0, 0], [4, 6, 5]),
])
def test_binary_search_labels_hand_computed(n, first_bad, labels, queried):
    passes, calls = oracle(first_bad)
    found, n_calls = P.first_unrecoverable_line(n, passes)
    assert found == first_bad
    assert calls == queried and n_calls == len(queried)
    assert P.line_labels(n, found) == labels


def test_binary_search_matches_a_linear_scan_in_ceil_log2_calls():
    for n in range(1, 65):
        for first_bad in range(1, n + 1):
            passes, calls = oracle(first_bad)
            linear = next(j for j in range(1, n + 1) if j == n or not passes(j))  # the independent answer
            calls.clear()
            found, n_calls = P.first_unrecoverable_line(n, passes)
            assert found == linear == first_bad
            assert n_calls == len(calls) <= math.ceil(math.log2(n))
            assert all(1 <= j < n for j in calls)  # never asks about the full (failed) response


def test_passing_response_is_all_ones_and_bad_first_line_rejected():
    assert P.line_labels(4, None) == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="first_bad"):
        P.line_labels(3, 4)
    with pytest.raises(ValueError, match=">= 1 line"):
        P.first_unrecoverable_line(0, lambda j: True)


def test_line_ends_and_prm_targets():
    texts = list("ab\nc\nd") + ["<eos>"]  # response tokens 0..6
    ends = P.line_end_indices(texts)
    assert ends == [2, 4]
    target, mask = P.prm_targets(ends, [1.0, 0.0], response_len=7, width=9)
    # label j sits at view index e_j + 1 (the state that has read line j's newline)
    assert mask.tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0]
    assert target.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0]
    # a line ending on the response's last token has no state after it: no target
    target, mask = P.prm_targets([1], [1.0], response_len=2, width=3)
    assert mask.sum() == 0
    with pytest.raises(ValueError, match="labels"):
        P.prm_targets([1, 2], [1.0], response_len=5, width=5)


def _two_rows():
    nl = 10
    # row 0: "ab\nc\nd" + EOS (line ends at 2 and 4); row 1: "x\n" (its only newline is the last token)
    ids = [[97, 98, nl, 99, nl, 100, 256], [120, nl]]
    values = torch.zeros(2, 7)
    values[0] = torch.arange(7) * 0.1  # PRM output at view index t
    values[1, :2] = torch.tensor([0.7, 0.9])
    return ids, values


def test_dense_rewards_hand_computed_fail_and_pass():
    ids, values = _two_rows()
    mask = P.line_end_mask(ids, {10}, width=7)
    assert mask.tolist() == [[0, 0, 1, 0, 1, 0, 0], [0] * 7]
    fail = P.dense_line_rewards(values, mask, torch.tensor([False, False]), 0.25, 0.025)
    # r[e] = lambda * PRM(view e + 1) / n_lines: e=2 -> 0.25*0.3/2, e=4 -> 0.25*0.5/2
    expect = torch.zeros(2, 7)
    expect[0, 2], expect[0, 4] = 0.25 * 0.3 / 2, 0.25 * 0.5 / 2
    torch.testing.assert_close(fail, expect)
    passed = P.dense_line_rewards(values, mask, torch.tensor([True, True]), 0.25, 0.025)
    torch.testing.assert_close(passed, expect / 10)


def test_token_rewards_add_dense_line_rewards_to_the_eos_outcome():
    from megarl.config import load_config
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch, Trajectory

    cfg = load_config(["configs/quickstart/code_prm.yaml"])
    ids, values = _two_rows()
    batch = StepBatch.from_trajectories([Trajectory("0", [1, 2], ids[0], [], "stop", score=1.0, acc=True),
                                         Trajectory("1", [1, 2], ids[1], [], "stop", score=0.0, acc=False)])
    batch.prm_rewards = P.dense_line_rewards(values, P.line_end_mask(ids, {10}, batch.width), batch.acc,
                                             cfg.prm.lambda_fail, cfg.prm.lambda_pass)
    rewards, metrics = rl.token_rewards(batch, cfg, 0.0, None)
    expect = torch.zeros(2, 7)
    expect[0, 2], expect[0, 4] = 0.025 * 0.3 / 2, 0.025 * 0.5 / 2  # passed: lambda_pass
    expect[0, 6] += 1.0  # outcome on EOS
    torch.testing.assert_close(rewards, expect)
    assert metrics["reward/prm_dense"] == pytest.approx((0.025 * 0.3 / 2 + 0.025 * 0.5 / 2) / 2)


def test_code_lines_rows_pass_the_sandbox_with_the_reference_and_fail_with_a_wrong_line(tmp_path):
    import json

    from megarl.rewards.code import CodeRewardParams, code_reward, parse_tests
    from megarl.tasks.code_lines import write_task_files

    paths = write_task_files(tmp_path, n_sft=3, n_train=3, n_eval=2, seed=0)
    sft = [json.loads(s) for s in paths["sft"].read_text().splitlines()]
    train = [json.loads(s) for s in paths["train"].read_text().splitlines()]
    assert train[0]["data_source"] == "code" and train[0]["tests"][0]["stdout"] == train[0]["answer"]
    params = CodeRewardParams(all_or_nothing=True, incorrect_score=0.0)
    row = sft[0]
    tests = [{"stdin": "", "stdout": row["answer"]}]
    assert code_reward(row["response"], tests, params).acc
    lines = row["response"].split("\n")
    lines[2] = lines[2].rsplit("*", 1)[0].rsplit("+", 1)[0].rsplit("-", 1)[0] + "+100000"  # break line 2
    assert not code_reward("\n".join(lines), parse_tests({"tests": tests}, None), params).acc
