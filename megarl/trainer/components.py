"""What an RL run is made of (models, engine, rollout worker, data, logging) and the phase
operations the loop calls on them: generation with the training state off the GPU, weight
sync, evaluation, checkpoints, resume."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl.parallel.distributed import phase
from megarl.rollout import SamplingParams
from megarl.trainer import build, checkpoint, pag, tools
from megarl.parallel import exchange
from megarl.trainer import rl, rows as row_flow
from megarl.trainer.batch import StepBatch
from megarl.trainer.metrics import MetricsLogger, PhaseTimer
from megarl.trainer.generation import RolloutWorker
from megarl.trainer.state import TrainerState
from megarl.trainer.train_model import TrainModel

log = logging.getLogger(__name__)


@dataclass
class RunComponents:
    cfg: object
    hf_config: object
    actor: TrainModel
    critic: TrainModel | None
    ref: TrainModel | None
    engine: object
    worker: RolloutWorker
    data: build.PromptData
    logger: MetricsLogger
    timer: PhaseTimer
    dp_group: object
    dp_rank: int
    dp_size: int
    prm: object | None = None  # megarl.trainer.prm.PrmScorer with prm.dense_reward
    topology: row_flow.RowTopology | None = None  # who trains which rows (megarl.trainer.rows)
    # this rank's rollout data over the run (`train` returns it; tools/bench/scale.py reads it): the
    # most payload bytes it held at once (its generated rows + the rows delivered to it), the rows
    # it trained (own_rows of them generated here), their tokens and image bytes
    row_stats: dict = field(default_factory=lambda: dict.fromkeys(
        ("held_peak_bytes", "trained_rows", "own_rows", "trained_prompt_tokens", "trained_response_tokens",
         "image_bytes", "moe_layers"), 0))

    @property
    def train_models(self) -> list[TrainModel]:
        prm = self.prm.model if self.prm is not None else None
        return [m for m in (self.actor, self.critic, self.ref, prm) if m is not None]

    @contextlib.contextmanager
    def training_state_off_gpu(self):
        """actor/critic/ref weights, grads and optimizer state leave the GPU meanwhile
        (rollout.offload_train_state; a no-op without CUDA)."""
        if self.cfg.rollout.offload_train_state:
            for m in self.train_models:
                m.offload()
        try:
            yield
        finally:
            for m in self.train_models:
                m.onload()

    def start_engine(self) -> None:
        """SGLang sizes its KV pool when it starts: start it on a GPU free of training state,
        then give everything back until the first weight sync. (The builtin engine has no start.)"""
        if hasattr(self.engine, "start"):
            with self.training_state_off_gpu():
                self.engine.start()
                self.engine.release_memory()

    def _tags(self, tags: list[str]) -> dict:
        return {"tags": tags} if self.cfg.rollout.engine == "sglang" else {}

    @contextlib.contextmanager
    def generation(self, release: bool):
        """The engine has the GPU while the training state is off it. Afterwards the engine's
        memory goes before the training state returns: all of it with `release` (training
        follows; the next `sync_weights` reloads the weights), else only the KV cache (the
        weights stay for the next generation)."""
        with self.training_state_off_gpu():
            self.engine.resume_memory()
            try:
                yield
            finally:
                if release:
                    self.engine.release_memory()
                else:
                    self.engine.release_memory(**self._tags(["kv_cache", "cuda_graph"]))

    def sync_weights(self, version: int) -> None:
        """Streams the actor's weights into the engine (only its weight memory resumed), which
        then generates for policy `version`. With rollout.offload_train_state the gradients and
        optimizer state leave the GPU first (and the other models entirely): the sync's peak is
        the trainer's weights + the engine's + one bucket. What is off stays off until
        `generation` moves the rest and brings everything back for training (or `save`). With
        rollout.sync_from_host the actor's weights leave too and stream from their host copies,
        bucket by bucket: the peak is the engine's weights + the stream's buffers. With
        rollout.weights_dtype=fp8 each bucket's linear weights leave quantized to block FP8."""
        from megarl.weights import stream_hf_weights
        from megarl.weights.fp8_blocks import quantized_stream

        ro = self.cfg.rollout
        with self.timer("weight_sync"):
            if ro.offload_train_state:
                for m in self.train_models:
                    m.offload(weights=m is not self.actor or ro.sync_from_host)
            self.engine.resume_memory(**self._tags(["weights"]))
            hosted = getattr(self.engine, "hosted_experts", None)  # an engine with expert parallelism
            stream = stream_hf_weights(self.actor.modules, self.hf_config, ro.weight_bucket_mb << 20,
                                       source=self.actor.host_weight if ro.sync_from_host else None,
                                       want_expert=None if hosted is None else lambda layer, e: e in hosted)
            self.engine.update_weights(quantized_stream(stream) if ro.weights_dtype == "fp8" else stream)
        self.worker.policy_version = version

    def evaluate(self, step: int) -> dict[str, float]:
        """avg@k accuracy (pass@1 averaged over k samples) per eval set and over all sets, from the
        rows' scalars (no routed experts are recorded; the payloads are freed at once)."""
        cfg, out = self.cfg, {}
        with phase("eval"), self.generation(release=False):  # one offload for all eval sets; the weights stay
            for ev in self.data.evals:
                s = {"n_samples": cfg.eval.n_samples, "temperature": cfg.eval.temperature,
                     "top_p": cfg.eval.top_p, "max_new_tokens": cfg.eval.max_new_tokens, **ev.sampling}
                sampling = SamplingParams(n=s["n_samples"], temperature=s["temperature"], top_p=s["top_p"],
                                          max_new_tokens=s["max_new_tokens"], seed=cfg.trainer.seed + step)
                rows = self.worker.generate(ev.items, self.data.encode(ev.items), sampling, routing=False)
                self.worker.free(rows)
                n = max(len(rows), 1)
                out[f"eval/{ev.name}/accuracy"] = sum(m.acc for m in rows) / n
                out[f"eval/{ev.name}/score"] = sum(m.score for m in rows) / n  # mean reward
                out[f"eval/{ev.name}/response_length"] = sum(m.response_len for m in rows) / n
                out.update(pag.eval_metrics(rows, f"eval/{ev.name}"))  # PAG: first / verify / final accuracy
                out.update(tools.eval_metrics(rows, f"eval/{ev.name}"))  # tool calls: call rate, turns, errors
        if out:
            out["eval/accuracy"] = sum(v for k, v in out.items() if k.endswith("/accuracy")) / len(self.data.evals)
            self.logger.log(step, out)
        return out

    # ---- the step's rows (megarl/trainer/rows.py) ------------------------------------------------
    @property
    def rank(self) -> int:
        return exchange.world()[0]

    def take_rows(self, rows: list, step: int, state: TrainerState) -> tuple[StepBatch, list[int], list[list[int]]]:
        """The rows this DP rank trains, delivered from wherever they were generated, as a StepBatch
        (in mini-batch order), their indices into `rows`, and the mini-batches as local row indices.
        Every other payload is freed but those `state` carries into the next step."""
        al, tr = self.cfg.algorithm, self.cfg.trainer
        home = [self.topology.dp_of[m.source] for m in rows]  # a row is trained where it was generated if it can be
        plan = rl.plan_minibatches([m.length for m in rows], al.mini_batch_size, tr.seed + step, self.dp_size, home)
        here, minibatches = rl.local_minibatches([mb[self.dp_rank] for mb in plan])
        with phase("deliver"):
            got = row_flow.deliver(self.worker.store, rows, rl.dp_of_rows(plan, len(rows)), self.topology, self.rank)
        st = self.row_stats
        st["held_peak_bytes"] = max(st["held_peak_bytes"], self.worker.store.nbytes
                                    + sum(row_flow.payload_bytes(t) for t in got.values()))
        st["trained_rows"] += len(got)
        st["own_rows"] += sum(rows[i].source == self.rank for i in got)
        st["trained_prompt_tokens"] += sum(len(t.prompt_ids) for t in got.values())
        st["trained_response_tokens"] += sum(len(t.response_ids) for t in got.values())
        st["image_bytes"] += sum(row_flow.image_bytes(t) for t in got.values())
        st["moe_layers"] = len(self.topology.layers_of[self.rank] or ())
        self.worker.store.retain(m.key for m in state.carried_rows if m.source == self.rank)
        return StepBatch.from_trajectories([got[i] for i in here]), here, minibatches

    def next_items(self, n: int):
        self.data.train.batch_prompts = n
        return self.data.train.next_batch()

    def save(self, state: TrainerState) -> None:
        for m in self.train_models:  # after a weight sync the optimizer state may be off the GPU
            m.onload()
        state.data = self.data.train.state_dict()
        models = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        checkpoint.save_checkpoint(self.cfg.trainer.run_dir, state.step, models, state.state_dict(),
                                   self.cfg.trainer.keep_last, self.cfg.trainer.async_save,
                                   rank_rows=row_flow.rank_rows(self.worker.store, state.carried_rows, self.rank))

    def resume(self, state: TrainerState) -> None:
        """Loads the newest complete checkpoint of the run dir into the models and `state`."""
        latest = checkpoint.read_latest(self.cfg.trainer.run_dir)
        if latest is None:
            return
        self.actor.load(str(latest / "actor"))
        if self.critic is not None:
            self.critic.load(str(latest / "critic"))
        state.load_state_dict(checkpoint.load_trainer_state(latest))
        self.worker.store.retain(())
        state.remap(row_flow.restore_rows(latest, self.worker.store, *exchange.world()))
        self.data.train.load_state_dict(state.data)
        if dist.get_rank() == 0:
            log.info("resumed from %s at step %d", latest, state.step)


def build_components(cfg: MegaRLConfig) -> RunComponents:
    from megatron.core import parallel_state as ps

    logger = MetricsLogger(cfg.trainer.run_dir, cfg=cfg)  # first: a logger that cannot start fails before the build
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    actor = build.build_actor(cfg, hf_config)
    critic = build.build_critic(cfg, hf_config, actor) if cfg.critic.enable else None
    ref = build.build_actor(cfg, hf_config, optim=False) if cfg.algorithm.kl_coef > 0 else None
    engine = build.build_engine(cfg, hf_config, tokenizer)
    rewards = build.build_rewards(cfg)
    images = build.image_inputs(cfg, hf_config, tokenizer)
    num_experts = int(getattr(actor.config, "num_moe_experts", None) or 0)
    worker = RolloutWorker(engine, tokenizer, rewards, cfg,
                           ranks_per_engine=cfg.parallel.rollout_tp if cfg.rollout.engine == "sglang" else 1,
                           images=images, routing_dtype=row_flow.routing_dtype(num_experts) if num_experts else None)
    topology = row_flow.RowTopology.gather(ps.get_data_parallel_rank(),
                                           actor.moe_layers if actor.uses_routed_experts else None, num_experts)
    return RunComponents(
        cfg=cfg, hf_config=hf_config, actor=actor, critic=critic, ref=ref, engine=engine, worker=worker,
        data=build.build_data(cfg, tokenizer, images), logger=logger,
        timer=PhaseTimer(), dp_group=ps.get_data_parallel_group(), dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), prm=_prm_scorer(cfg, hf_config, tokenizer), topology=topology,
    )


def _prm_scorer(cfg: MegaRLConfig, hf_config, tokenizer):
    if not cfg.prm.dense_reward:
        return None
    from megarl.trainer.prm import PrmScorer

    return PrmScorer(cfg, hf_config, tokenizer)
