"""Settings that reach megatron's configs: the optimizer (CPU offload needs the precision-aware
distributed optimizer) and the sequence padding that SP / FP8 / CP need."""

from types import SimpleNamespace

import pytest

from megarl.config.schema import OptimConfig
from megarl.trainer.batch import StepBatch, Trajectory, build_microbatch
from megarl.trainer.train_model import optimizer_config, sequence_pad_multiple


def test_offloaded_optimizer_is_megatrons_precision_aware_hybrid_optimizer(monkeypatch):
    import megatron.core.optimizer.optimizer_config as oc

    monkeypatch.setattr(oc, "is_te_min_version", lambda v: True)  # the GPU image ships TE 2.11
    cfg = optimizer_config(OptimConfig(offload_optimizer=True, lr=3e-6, weight_decay=0.05), "bf16")
    assert cfg.optimizer_cpu_offload and cfg.use_precision_aware_optimizer and cfg.optimizer_offload_fraction == 1.0
    assert cfg.use_distributed_optimizer and cfg.bf16 and (cfg.lr, cfg.weight_decay) == (3e-6, 0.05)
    plain = optimizer_config(OptimConfig(), "fp16")
    assert not plain.optimizer_cpu_offload and not plain.use_precision_aware_optimizer and plain.fp16


@pytest.mark.parametrize("tp, sp, fp8, te, cp, expected", [
    (1, False, None, False, 1, 1), (4, False, None, False, 1, 1), (4, True, None, False, 1, 4),
    (4, True, "e4m3", True, 1, 16), (2, False, None, True, 3, 6), (8, True, "hybrid", True, 2, 16),
    (2, True, "e4m3", True, 3, 48),
])
def test_sequence_pad_multiple(tp, sp, fp8, te, cp, expected):
    config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp, fp8=fp8, context_parallel_size=cp)
    assert sequence_pad_multiple(config, te) == expected


def test_thd_microbatch_pads_every_sequence_and_builds_no_dense_mask():
    trajs = [Trajectory("a", [5, 6, 7], [8, 9], [0.0, 0.0], "stop"), Trajectory("b", [5], [9, 9, 9, 9, 9], [0.0] * 5, "stop")]
    batch = StepBatch.from_trajectories(trajs)
    mb = build_microbatch(batch, [0, 1], row_tokens=None, pad_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 16]  # 5 -> 8 and 6 -> 8 tokens
    assert mb.input_ids.shape == (1, 16) and mb.input_ids.shape[1] % 4 == 0
    assert mb.input_ids[0, :5].tolist() == [5, 6, 7, 8, 9] and mb.input_ids[0, 8:14].tolist() == [5, 9, 9, 9, 9, 9]
    # response token j of a sample is predicted at offset + P - 1 + j of its sequence
    assert mb.resp_index.tolist() == [[2, 3, 0, 0, 0], [8, 9, 10, 11, 12]]
    assert mb.position_ids[0, 8:16].tolist() == list(range(8))
    # the dense mask exists only when megatron's local attention asks for it: block-causal
    mask = mb.attention_mask()[0, 0]  # True = masked
    assert mask.shape == (16, 16)
    assert not mask[9, 8] and mask[8, 9] and mask[9, 7] and mask[12, 0]  # no attention across sequences
    assert not mask[4, 0] and not mask[7, 7]
