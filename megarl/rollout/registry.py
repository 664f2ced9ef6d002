"""Engine registry: `rollout.engine` config name -> constructor."""

from __future__ import annotations

from typing import Any, Callable

from megarl.rollout.types import RolloutEngine


def _builtin(**kwargs: Any) -> RolloutEngine:
    """model_path=<hf dir> (from_pretrained), or config=<HF config> (weights streamed later)."""
    from megarl.rollout.builtin import BuiltinEngine

    if "model_path" in kwargs:
        return BuiltinEngine.from_pretrained(kwargs.pop("model_path"), **kwargs)
    if "config" in kwargs:
        return BuiltinEngine(kwargs.pop("config"), **kwargs)
    raise ValueError("make_engine('builtin'): pass model_path=<hf dir> or config=<HF config>")


def _sglang(**kwargs: Any) -> RolloutEngine:
    """model_path=<hf dir>, group=<gloo group of the engine's ranks>, SGLang server arguments.

    Nothing starts here: SGLang sizes its KV pool when it starts, which `start()` or the first
    `resume_memory()` does, once the training state is off the GPU.
    """
    from megarl.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(**kwargs)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"builtin": _builtin, "sglang": _sglang}


def make_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Builds the rollout engine named by config (`rollout.engine`)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r} (choose from {sorted(ENGINES)})")
    return ENGINES[name](**kwargs)
