"""Packed micro-batches meet Transformer Engine's FP8 token alignment on every rank, for every
shipped layout (configs/layouts) and every FP8 recipe of model.fp8_recipe.

What TE 2.11 asks of one rank's input to an FP8 linear layer (after CP sharding and the
sequence-parallel split of the packed row), stated here from its checks, apart from megarl's own
alignment table (`megarl.trainer.train_model.fp8_token_alignment`):
- `assert_dim_for_fp8_exec`: the rows (tokens) a multiple of 8;
- cuBLAS FP8 GEMMs: leading dimensions a multiple of 16, and the weight-gradient GEMM's reduced
  dimension is the tokens;
- MXFP8: scale blocks of 32 along both dimensions;
- blockwise under SP: the column-parallel input is all-gathered and must be quantizable in 1x128
  blocks, so its rows a multiple of 128.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import random
from types import SimpleNamespace

import pytest

from megarl.config import load_config
from megarl.trainer.batch import StepBatch, TokenLayout, Trajectory, split_microbatches
from megarl.trainer.build import model_options
from megarl.trainer.train_model import token_layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")
LAYOUTS = sorted(glob.glob(os.path.join(CONFIGS, "layouts", "**", "*.yaml"), recursive=True))
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def te_accepts(tokens: int, recipe: str | None, all_gathered: bool) -> bool:
    """Whether TE's FP8 linear layers take `tokens` rows on one rank (any count without FP8)."""
    if recipe is None:
        return True
    ok = tokens % 8 == 0 and tokens % 16 == 0
    if recipe == "mxfp8":
        ok = ok and tokens % 32 == 0
    if recipe == "blockwise" and all_gathered:
        ok = ok and tokens % 128 == 0
    return ok


@functools.lru_cache(maxsize=None)
def layout_config(path: str):
    """The layout composed after its model's recipes (the first one: layouts set every parallel field)."""
    model = os.path.relpath(path, os.path.join(CONFIGS, "layouts")).split(os.sep)[0]
    recipe = sorted(glob.glob(os.path.join(CONFIGS, "recipes", model, "*.yaml")))[0]
    return load_config([recipe, path])


def megatron_view(cfg, recipe: str | None):
    """The TransformerConfig fields the packing reads, as megarl.trainer.build sets them."""
    model = dataclasses.replace(cfg.model, fp8=None if recipe is None else "e4m3", fp8_recipe=recipe or "delayed")
    opts = model_options(model, cfg.parallel)
    return SimpleNamespace(tensor_model_parallel_size=cfg.parallel.tp, context_parallel_size=cfg.parallel.cp,
                           sequence_parallel=opts["sequence_parallel"], fp8=opts.get("fp8"),
                           fp8_recipe=opts.get("fp8_recipe", "delayed"))


def random_batch(rng: random.Random, n: int, longest: int) -> StepBatch:
    trajs = []
    for i in range(n):
        total = max(2, int(longest ** rng.random()))  # log-uniform: many short rows, a few long ones
        prompt = rng.randint(1, total - 1)
        trajs.append(Trajectory(f"u{i}", [7] * prompt, [9] * (total - prompt), [0.0] * (total - prompt), "stop"))
    return StepBatch.from_trajectories(trajs)


@pytest.mark.parametrize("recipe", (None,) + FP8_RECIPES)
@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: os.path.relpath(p, os.path.join(CONFIGS, "layouts")))
def test_every_rank_of_every_shipped_layout_gets_te_aligned_tokens(path, recipe):
    cfg = layout_config(path)
    config = megatron_view(cfg, recipe)
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    sp = tp if config.sequence_parallel else 1
    layout = token_layout(config)
    max_tokens = cfg.actor.max_tokens_per_microbatch
    rng = random.Random(f"{path}:{recipe}")
    shortest = StepBatch.from_trajectories([Trajectory("s", [7], [9], [0.0], "stop")])  # the smallest row
    for batch, budget in [(shortest, max_tokens)] + [(random_batch(rng, 12, 4096), b) for b in
                                                     (max_tokens, rng.randint(4096, max_tokens), 4096)]:
        for mb in split_microbatches(batch, list(range(len(batch))), budget, layout):
            width = mb.input_ids.shape[1]
            assert width <= max(budget, layout.row_multiple) or len(mb.rows) == 1
            for r in range(cp):  # as TrainModel.microbatches shards them, then SP splits the share
                local = mb.cp_shard(r, cp).input_ids.shape[1] if cp > 1 else width
                assert local % sp == 0, f"{local} tokens of CP rank {r} do not split over {sp} SP ranks"
                assert te_accepts(local // sp, recipe, sp > 1), (
                    f"{os.path.basename(path)} tp={tp} sp={sp} cp={cp} {recipe}: row of {width} tokens "
                    f"{mb.cu_seqlens.tolist()} leaves {local // sp} tokens on a rank")


def test_a_short_sequence_at_tp8_sp_pads_the_row_not_the_sequence():
    """The failing case of the old per-sequence padding: one 16-token sequence at TP 8 with SP gave
    each rank 2 tokens; now the row is 8 * 16 tokens and the sequence keeps its own length."""
    layout = token_layout(SimpleNamespace(tensor_model_parallel_size=8, sequence_parallel=True, fp8="e4m3",
                                          fp8_recipe="delayed", context_parallel_size=1))
    batch = StepBatch.from_trajectories([Trajectory("a", [5] * 10, [6] * 6, [0.0] * 6, "stop")])
    (mb,) = split_microbatches(batch, [0], 32768, layout)
    assert mb.cu_seqlens.tolist() == [0, 128] and layout.local_tokens([0, 128]) == [16] * 8
    assert mb.input_ids[0, :16].tolist() == [5] * 10 + [6] * 6 and not mb.input_ids[0, 16:].any()


def test_the_contract_is_checked_where_micro_batches_are_made(monkeypatch):
    """A packing that forgets the row padding fails on the CPU, before any GPU run."""
    with pytest.raises(ValueError, match=r"leaves \[2\] tokens on some rank .* multiple of 16"):
        TokenLayout(cp=1, sp=8, align=16).check([0, 16])
    with pytest.raises(ValueError, match="do not split over 4 sequence-parallel ranks"):
        TokenLayout(cp=2, sp=4, align=1).check([0, 4, 8, 12])
    TokenLayout(cp=2, sp=4, align=16).check([0, 60, 64, 128])  # 2*cp per sequence, 16 per rank part

    import megarl.trainer.batch as batch_mod

    real = batch_mod.build_microbatch
    monkeypatch.setattr(batch_mod, "build_microbatch",
                        lambda *a, row_multiple=1, **k: real(*a, **k))  # drops the row padding
    batch = StepBatch.from_trajectories([Trajectory("a", [5] * 10, [6] * 6, [0.0] * 6, "stop")])
    with pytest.raises(ValueError, match="FP8 alignment"):
        split_microbatches(batch, [0], 32768, TokenLayout(cp=1, sp=8, align=16))
