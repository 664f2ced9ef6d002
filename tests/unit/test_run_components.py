"""The colocated phase order around the rollout engine (SGLang cannot run here: a recording
stand-in with SGLang's start / release / resume surface takes its place)."""

import types

import megarl.weights
from megarl.config import load_config
from megarl.trainer.components import RunComponents
from megarl.trainer.metrics import PhaseTimer


class Recorder:
    def __init__(self, log, name, engine=False):
        self.log, self.name = log, name
        if engine:
            self.start = lambda: log.append("engine.start")

    def offload(self, weights=True):
        self.log.append(f"{self.name}.offload" + ("" if weights else "(state)"))

    def onload(self):
        self.log.append(f"{self.name}.onload")

    def release_memory(self, tags=None):
        self.log.append(f"engine.release{tags or ''}")

    def resume_memory(self, tags=None):
        self.log.append(f"engine.resume{tags or ''}")

    def update_weights(self, stream):
        self.log += [f"engine.update {bucket}" for bucket in stream]


def components(engine="sglang", offload=True):
    log = []
    cfg = load_config(None, [f"rollout.engine={engine}", f"rollout.offload_train_state={str(offload).lower()}"])
    run = RunComponents(cfg=cfg, hf_config=None, actor=Recorder(log, "actor"), critic=Recorder(log, "critic"),
                        ref=None, engine=Recorder(log, "engine", engine=engine == "sglang"),
                        worker=types.SimpleNamespace(policy_version=None), data=None,
                        logger=None, timer=PhaseTimer(), dp_group=None, dp_rank=0, dp_size=1)
    return run, log


def test_sglang_starts_on_a_gpu_free_of_training_state():
    run, log = components()
    run.start_engine()
    assert log == ["actor.offload", "critic.offload", "engine.start", "engine.release", "actor.onload", "critic.onload"]


def test_rollout_releases_everything_before_the_training_state_returns():
    run, log = components()
    with run.generation(release=True):
        log.append("generate")
    assert log == ["actor.offload", "critic.offload", "engine.resume", "generate", "engine.release",
                   "actor.onload", "critic.onload"]


def test_eval_keeps_the_engine_weights_and_frees_its_kv_cache():
    run, log = components()
    with run.generation(release=False):
        log.append("generate")
    assert log[3:5] == ["generate", "engine.release['kv_cache', 'cuda_graph']"]


def test_builtin_engine_has_no_start_and_takes_no_tags():
    run, log = components(engine="builtin", offload=False)
    run.start_engine()
    with run.generation(release=False):
        pass
    assert log == ["engine.resume", "engine.release", "actor.onload", "critic.onload"]


def test_weight_sync_streams_after_the_training_state_and_before_the_weights_leave(monkeypatch):
    """The actor's gradients and optimizer state (the critic entirely) leave before the engine's
    weights come back; the actor's weights stay for the stream and leave with generation."""
    run, log = components()
    monkeypatch.setattr(megarl.weights, "stream_hf_weights", lambda modules, cfg, bucket, **kw: iter(["b0", "b1"]))
    run.actor.modules = []
    run.sync_weights(3)
    assert log == ["actor.offload(state)", "critic.offload", "engine.resume['weights']", "engine.update b0",
                   "engine.update b1"]
    assert run.worker.policy_version == 3
    with run.generation(release=True):
        pass
    assert log[5:8] == ["actor.offload", "critic.offload", "engine.resume"]


def test_weight_sync_moves_nothing_without_offload_train_state(monkeypatch):
    run, log = components(offload=False)
    monkeypatch.setattr(megarl.weights, "stream_hf_weights", lambda modules, cfg, bucket, **kw: iter(["b0"]))
    run.actor.modules = []
    run.sync_weights(1)
    assert log == ["engine.resume['weights']", "engine.update b0"]
