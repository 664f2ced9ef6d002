"""Value pretraining by a criterion: algorithm.value_pretrain_steps is the cap,
algorithm.value_pretrain_ev_target ends it early; where it ended is checkpointed and the actor's
lr schedule starts there."""

from __future__ import annotations

import io

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.trainer import rl
from megarl.trainer.loop import policy_start
from megarl.trainer.state import TrainerState
from megarl.trainer.train_model import lr_at

VAPO = "configs/algorithms/vapo.yaml"


def test_steps_alone_pretrain_for_exactly_the_cap():
    cfg = load_config(VAPO, ["algorithm.value_pretrain_steps=3"])
    assert [rl.value_pretraining(cfg, s) for s in range(5)] == [True, True, True, False, False]
    assert not rl.value_pretraining_converged(cfg, 0.99)  # no target: only the cap ends it
    assert policy_start(cfg.algorithm, TrainerState()) == 3


def test_target_ends_pretraining_and_the_actor_schedule_starts_there():
    cfg = load_config(VAPO, ["algorithm.value_pretrain_steps=10", "algorithm.value_pretrain_ev_target=0.3"])
    assert not rl.value_pretraining_converged(cfg, 0.29)
    assert rl.value_pretraining_converged(cfg, 0.3)
    state = TrainerState(value_pretrain_end=4)  # met the target at step 3
    assert [rl.value_pretraining(cfg, s, state.value_pretrain_end) for s in (3, 4, 12)] == [False, False, False]
    assert policy_start(cfg.algorithm, state) == 4
    # warm-up 20 steps counted from the first policy step: step 4 gets lr/20, step 23 the full lr
    a = cfg.actor
    assert lr_at(4 - policy_start(cfg.algorithm, state), a, 100) == pytest.approx(a.lr / 20)
    assert lr_at(23 - policy_start(cfg.algorithm, state), a, 100) == pytest.approx(a.lr)


def test_pretraining_end_survives_a_checkpoint_round_trip():
    buf = io.BytesIO()
    torch.save(TrainerState(step=7, value_pretrain_end=5).state_dict(), buf)
    buf.seek(0)
    restored = TrainerState()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert (restored.step, restored.value_pretrain_end) == (7, 5)
    old = TrainerState(step=7).state_dict()
    del old["value_pretrain_end"]  # a checkpoint written before the field existed
    restored.load_state_dict(old)
    assert restored.value_pretrain_end is None


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.value_pretrain_steps=0", "algorithm.value_pretrain_ev_target=0.3"], "value_pretrain_steps > 0"),
    (["algorithm.value_pretrain_ev_target=1.5"], "at most 1"),
])
def test_bad_targets_fail_at_load(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(VAPO, overrides)
    assert "algorithm.value_pretrain_ev_target" in str(e.value) and message in str(e.value)
