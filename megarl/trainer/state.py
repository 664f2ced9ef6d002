"""The resumable state of an RL run besides the models: step, data position, RNG, carried
rows (dynamic-sampling groups; T-PPO's unfinished responses), the KL coefficient. One object,
saved in every checkpoint as `trainer_state.pt` by rank 0 (tensors and plain values only: it
loads with torch.load(weights_only=True)). The carried rows are RowMetas: their payloads stay with
the rank that generated them, which saves them itself (megarl.trainer.rows.save_rows)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from megarl.trainer.rows import RowMeta


@dataclass
class TrainerState:
    step: int = 0  # rollout steps completed
    data: dict = field(default_factory=dict)  # the prompt sampler's state_dict
    carried_groups: list[list[RowMeta]] = field(default_factory=list)  # dynamic-sampling groups for the next step
    kl_coef: float = 0.0  # current KL coefficient (changes under the adaptive controller)
    in_flight: list[RowMeta] = field(default_factory=list)  # T-PPO: unfinished responses for the next window
    # the step at which value pretraining ended early (algorithm.value_pretrain_ev_target met): policy
    # training and the actor's lr schedule start there; None: pretraining runs to value_pretrain_steps
    value_pretrain_end: int | None = None

    def state_dict(self) -> dict:
        """This state plus the global RNG states (python, numpy, torch), as of now."""
        return {"step": self.step, "data": self.data, "kl_coef": self.kl_coef,
                "carried_groups": [[dataclasses.asdict(m) for m in g] for g in self.carried_groups],
                "in_flight": [dataclasses.asdict(m) for m in self.in_flight], "value_pretrain_end": self.value_pretrain_end,
                "rng": _get_rng()}

    @property
    def carried_rows(self) -> list[RowMeta]:
        """Every row this state carries into the next step (their payloads must stay)."""
        return [m for g in self.carried_groups for m in g] + list(self.in_flight)

    def remap(self, where: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Points the carried rows at their payloads' new (source, key) after a resume."""
        def moved(m: RowMeta) -> RowMeta:
            source, key = where[m.ref]
            return dataclasses.replace(m, source=source, key=key)
        self.carried_groups = [[moved(m) for m in g] for g in self.carried_groups]
        self.in_flight = [moved(m) for m in self.in_flight]

    def load_state_dict(self, sd: dict) -> None:
        """Restores the state and the global RNG states saved with it."""
        self.step, self.data, self.kl_coef = int(sd["step"]), sd["data"], float(sd["kl_coef"])
        self.carried_groups = [[_meta(t) for t in g] for g in sd["carried_groups"]]
        self.in_flight = [_meta(t) for t in sd.get("in_flight", [])]  # absent in pre-T-PPO checkpoints
        end = sd.get("value_pretrain_end")  # absent in checkpoints before the explained-variance target
        self.value_pretrain_end = None if end is None else int(end)
        _set_rng(sd["rng"])


def _meta(d: dict) -> RowMeta:
    if "prompt_ids" in d:
        raise ValueError("trainer_state.pt holds carried trajectories of a megarl before per-rank row payloads; "
                         "resume it with that version, or start the run again from its model checkpoint")
    return RowMeta(**d)


def _get_rng() -> dict:
    py = random.getstate()
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": list(py[1]), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_extra": [int(pos), int(has_gauss), float(gauss)], "torch": torch.get_rng_state()}


def _set_rng(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), None))
    pos, has_gauss, gauss = state["numpy_extra"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
