"""Settings that reach megatron's configs: the optimizer (CPU offload needs the precision-aware
distributed optimizer) and the sequence padding that SP / FP8 / CP need."""

from types import SimpleNamespace

import pytest

from megarl.config.schema import OptimConfig
from megarl.trainer.batch import StepBatch, Trajectory, build_microbatch
from megarl.trainer.train_model import optimizer_config, token_layout


def test_offloaded_optimizer_is_megatrons_precision_aware_hybrid_optimizer(monkeypatch):
    import megatron.core.optimizer.optimizer_config as oc

    monkeypatch.setattr(oc, "is_te_min_version", lambda v: True)  # the GPU image ships TE 2.11
    cfg = optimizer_config(OptimConfig(offload_optimizer=True, lr=3e-6, weight_decay=0.05), "bf16")
    assert cfg.optimizer_cpu_offload and cfg.use_precision_aware_optimizer and cfg.optimizer_offload_fraction == 1.0
    assert cfg.use_distributed_optimizer and cfg.bf16 and (cfg.lr, cfg.weight_decay) == (3e-6, 0.05)
    plain = optimizer_config(OptimConfig(), "fp16")
    assert not plain.optimizer_cpu_offload and not plain.use_precision_aware_optimizer and plain.fp16


def test_offloaded_optimizer_config_builds_without_transformer_engine(monkeypatch):
    """megatron's precision-aware check compares TE's version (None without TE); the hybrid
    optimizer needs no TE, so the config builds, and megatron's check is left as it was."""
    import megatron.core.optimizer.optimizer_config as oc
    import megatron.core.utils as mu

    monkeypatch.setattr(mu, "get_te_version", lambda: None)
    check = oc.is_te_min_version
    cfg = optimizer_config(OptimConfig(offload_optimizer=True), "bf16")
    assert cfg.optimizer_cpu_offload and not cfg.store_param_remainders
    assert oc.is_te_min_version is check


@pytest.mark.parametrize("tp, sp, fp8, recipe, cp, per_sequence, per_row", [
    (1, False, None, "delayed", 1, 1, 1), (4, False, None, "delayed", 1, 1, 1), (4, True, None, "delayed", 1, 1, 4),
    (4, True, "e4m3", "delayed", 1, 1, 64), (2, False, None, "delayed", 3, 6, 6),
    (8, True, "hybrid", "tensorwise", 2, 4, 256), (2, True, "e4m3", "mxfp8", 3, 6, 192),
    (1, False, None, "delayed", 2, 4, 4), (8, True, "e4m3", "blockwise", 1, 1, 1024),
    (8, False, "e4m3", "blockwise", 1, 1, 16), (1, False, "e4m3", "mxfp8", 1, 1, 32),
])
def test_token_layout(tp, sp, fp8, recipe, cp, per_sequence, per_row):
    """Sequences pad to 2*CP only; the row pads so each CP share splits over the SP ranks into
    FP8-aligned parts (16 tokens; 32 MXFP8; 128 blockwise when SP all-gathers its input)."""
    config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp, fp8=fp8, fp8_recipe=recipe,
                             context_parallel_size=cp)
    layout = token_layout(config)
    assert (layout.sequence_multiple, layout.row_multiple) == (per_sequence, per_row)


def test_thd_microbatch_pads_every_sequence():
    trajs = [Trajectory("a", [5, 6, 7], [8, 9], [0.0, 0.0], "stop"), Trajectory("b", [5], [9, 9, 9, 9, 9], [0.0] * 5, "stop")]
    batch = StepBatch.from_trajectories(trajs)
    mb = build_microbatch(batch, [0, 1], pad_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 16]  # 5 -> 8 and 6 -> 8 tokens
    assert mb.input_ids.shape == (1, 16) and mb.input_ids.shape[1] % 4 == 0
    assert mb.input_ids[0, :5].tolist() == [5, 6, 7, 8, 9] and mb.input_ids[0, 8:14].tolist() == [5, 9, 9, 9, 9, 9]
    # response token j of a sample is predicted at offset + P - 1 + j of its sequence
    assert mb.resp_index.tolist() == [[2, 3, 0, 0, 0], [8, 9, 10, 11, 12]]
    assert mb.owner.tolist() == [[2, 3, -1, -1, -1], [8, 9, 10, 11, 12]]
    assert mb.position_ids[0, 8:16].tolist() == list(range(8))


def test_cp_shard_keeps_the_load_balanced_chunks_and_owners():
    """cp=2, sequences padded to 8: rank 0 holds chunks 0 and 3 of each (positions 0-1, 6-7 and
    8-9, 14-15), rank 1 chunks 1 and 2; every response token is held by exactly one rank."""
    trajs = [Trajectory("a", [5, 6, 7], [8, 9], [0.0, 0.0], "stop"), Trajectory("b", [5], [9, 9, 9, 9, 9], [0.0] * 5, "stop")]
    mb = build_microbatch(StepBatch.from_trajectories(trajs), [0, 1], pad_multiple=4)
    r0, r1 = mb.cp_shard(0, 2), mb.cp_shard(1, 2)
    assert r0.input_ids[0].tolist() == [5, 6, 0, 0, 5, 9, 0, 0]
    assert r1.input_ids[0].tolist() == [7, 8, 9, 0, 9, 9, 9, 9]
    # response positions 2, 3 | 8..12 -> rank 0 holds 8, 9 (local 4, 5); rank 1 holds 2, 3, 10, 11, 12
    assert r0.owner.tolist() == [[-1, -1, -1, -1, -1], [4, 5, -1, -1, -1]]
    assert r1.owner.tolist() == [[0, 1, -1, -1, -1], [-1, -1, 4, 5, 6]]
