"""What a step's rollout data costs each rank as the world grows (tools/bench/scale.py): the RL
loop on the tiny Qwen3-MoE with routing replay at TP 2 (so every row also goes to its replica's
other TP rank) on 2 and 4 gloo ranks, the same global batch. Per rank, the payload bytes delivered
and the most payload bytes held halve with DP, and the planner's row formula
(megarl.planner.rollout_data.row_bytes) predicts the delivered bytes within 10%."""

import json

from tests.distributed.launch import CPU_ONLY, REPO

pytestmark = CPU_ONLY


def test_per_rank_rollout_bytes_fall_with_dp_and_match_the_planner(tmp_path, monkeypatch):
    from tools.bench import scale

    monkeypatch.chdir(REPO)
    out = tmp_path / "scale.json"
    assert scale.main(["--worlds", "2,4", "--models", "moe", "--modes", "batch", "--tp", "2", "--steps", "1",
                       "--prompts", "16", "--root", str(tmp_path / "work"), "--json", str(out)]) == 0
    w2, w4 = json.loads(out.read_text())
    assert (w2["world"], w4["world"]) == (2, 4)
    assert w2["payload_bytes"] > 0 and w4["payload_bytes"] <= 0.6 * w2["payload_bytes"], (w2, w4)
    assert w4["held_peak_bytes"] <= 0.6 * w2["held_peak_bytes"], (w2, w4)
    assert w2["formula_ratio"] <= 0.1 and w4["formula_ratio"] <= 0.1, (w2, w4)
