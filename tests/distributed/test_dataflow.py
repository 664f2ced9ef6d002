"""Every DP rank runs the same number of micro-batches where the model's collectives span DP ranks
(megarl.trainer.train_model.TrainModel.microbatches), 2 gloo ranks (tests/distributed/scripts_dataflow.py):
expert parallelism EP=2 across the two DP ranks, with a token budget that gives them 1 and 2
micro-batches, and with one DP rank holding no row. Both complete (before, the ranks disagreed on
the number of all-to-alls and hung), and the EP=2 update equals the EP=1 one."""

import math

import pytest

from tests.distributed.launch import CPU_ONLY, worker_fixture

pytestmark = CPU_ONLY
parts = worker_fixture("scripts_dataflow.py", 2, timeout=600, name="parts")


def close(a, b) -> bool:
    return abs(a - b) <= 1e-6 + 1e-5 * abs(b)


@pytest.mark.parametrize("case", ["uneven", "empty"])
def test_expert_parallel_across_dp_with_unequal_microbatches_equals_ep1(parts, case):
    ep1, ep2 = (parts[0][f"{case}_ep{e}"] for e in (1, 2))
    own = [p[f"{case}_ep2"]["own_microbatches"] for p in parts]
    if case == "uneven":
        assert own == [1, 2]  # the DP ranks' own token-budget micro-batches differ
    else:
        assert [p[f"{case}_ep2"]["rows"] for p in parts] == [[0], []] and own == [1, 0]
    assert max(abs(a - b) for x, y in zip(ep2["old_logprobs"], ep1["old_logprobs"]) for a, b in zip(x, y)) < 1e-5
    for key in ("losses", "grad_norms"):
        for g, r in zip(ep2[key], ep1[key]):
            assert math.isfinite(r) and close(g, r), (case, key, g, r)
    assert ep1["grad_norms"][0] > 0 and ep1["losses"][1] != pytest.approx(ep1["losses"][0], abs=1e-7)
    assert ep2["weights_max_rel_diff"] < 1e-4, ep2["weights_max_rel_diff"]
