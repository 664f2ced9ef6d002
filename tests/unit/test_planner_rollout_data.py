"""The planner's rollout-data formula (megarl/planner/rollout_data.py) against what megarl's data
path really sends: `row_bytes` against the encoded rows of megarl.trainer.rows, META_BYTES against
pickled RowMetas, and the per-rank figures' scaling with DP."""

import pickle
import random

import pytest
import torch

from megarl.config import load_config
from megarl.planner import load_arch, plan, GPUS
from megarl.planner.rollout_data import META_BYTES, row_bytes
from megarl.trainer.batch import Trajectory
from megarl.trainer.rows import RowMeta, for_rank, meta_of, wire_bytes


def rows(n, layers, topk, dtype, images, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        P, R = rng.randint(5, 300), rng.randint(1, 2000)
        routed = torch.randint(0, 100, (P + R, layers, topk), dtype=torch.int16) if layers else None
        t = Trajectory(f"dapo-train-{i:06d}", list(range(P)), list(range(R)), [-0.5] * R, "stop", score=1.0, acc=True,
                       routed_experts=routed, pixel_values=torch.ones(64, 1176) if images else None,
                       image_grid_thw=torch.ones(1, 3, dtype=torch.long) if images else None)
        out.append(for_rank(t, tuple(range(layers)) if layers else None, dtype))
    return out


@pytest.mark.parametrize("layers,dtype,images", [(0, torch.uint8, False), (4, torch.uint8, False),
                                                  (3, torch.int16, False), (2, torch.uint8, True)])
def test_row_bytes_is_the_encoded_size(layers, dtype, images):
    batch = rows(40, layers, 2, dtype, images)
    prompt = sum(len(t.prompt_ids) for t in batch) / len(batch)
    response = sum(len(t.response_ids) for t in batch) / len(batch)
    img = 64 * 1176 * 4 + 24 if images else 0.0
    predicted = len(batch) * row_bytes(prompt, response, layers, 2, dtype.itemsize, img)
    assert predicted == pytest.approx(wire_bytes(batch), rel=0.01)
    short = rows(40, layers, 2, dtype, images, seed=1)  # the fixed part matters for short rows
    for t in short:
        t.prompt_ids, t.response_ids, t.rollout_logprobs = [1] * 3, [2], [0.0]
        t.routed_experts = t.routed_experts[:4] if layers else None
    assert 40 * row_bytes(3, 1, layers, 2, dtype.itemsize, img) == pytest.approx(wire_bytes(short), rel=0.05)


def test_meta_bytes_is_a_pickled_rowmeta():
    metas = [meta_of(t, i % 8, i) for i, t in enumerate(rows(200, 0, 2, torch.uint8, False))]
    assert len(pickle.dumps(metas)) / len(metas) == pytest.approx(META_BYTES, rel=0.15)
    assert isinstance(metas[0], RowMeta)


def test_per_rank_payload_falls_with_dp_and_the_plan_prints_it():
    cfg = load_config(["configs/recipes/qwen3-235b-a22b/dapo.yaml", "configs/layouts/qwen3-235b-a22b/16node.yaml"])
    arch, hf, _ = load_arch(cfg)
    figures = {}
    for nodes in (16, 32):
        cfg.parallel.nodes = nodes
        figures[nodes] = plan(cfg, arch, hf, GPUS["h100"]).rollout_data
    assert figures[32]["received"] == pytest.approx(figures[16]["received"] / 2)  # DP doubles
    assert figures[32]["rows_per_rank"] * 2 == figures[16]["rows_per_rank"]
    # routed experts of the stage's MoE layers only (PP 4 of 94 layers), one byte each (128 experts)
    rd = figures[16]
    P, R = 256, cfg.rollout.max_new_tokens // 2
    stage = -(-arch.moe_layers // cfg.parallel.pp)
    assert rd["received"] == pytest.approx(rd["rows_per_rank"] * (68 + 28 + 8 * (P + R) - 4 * P
                                                                   + (P + R) * stage * arch.moe_topk), rel=1e-6)
