"""Engine registry: `rollout.engine` config name (or `package.module:factory` of your own engine) -> constructor."""

from __future__ import annotations

from typing import Any

from megarl.registry import Registry
from megarl.rollout.types import RolloutEngine

ENGINES = Registry("rollout engine")


@ENGINES.register("builtin")
def _builtin(**kwargs: Any) -> RolloutEngine:
    """model_path=<hf dir> (from_pretrained), or config=<HF config> (weights streamed later)."""
    from megarl.rollout.builtin import BuiltinEngine

    if "model_path" in kwargs:
        return BuiltinEngine.from_pretrained(kwargs.pop("model_path"), **kwargs)
    if "config" in kwargs:
        return BuiltinEngine(kwargs.pop("config"), **kwargs)
    raise ValueError("make_engine('builtin'): pass model_path=<hf dir> or config=<HF config>")


@ENGINES.register("sglang")
def _sglang(**kwargs: Any) -> RolloutEngine:
    """model_path=<hf dir>, group=<gloo group of the engine's ranks>, SGLang server arguments.

    Nothing starts here: SGLang sizes its KV pool when it starts, which `start()` or the first
    `resume_memory()` does, once the training state is off the GPU.
    """
    from megarl.rollout.sglang.engine import SGLangEngine

    return SGLangEngine(**kwargs)


def make_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Builds the rollout engine named by config (`rollout.engine`): a registered name, or a
    dotted path to a factory taking the same keyword arguments."""
    try:
        factory = ENGINES.resolve(name, "rollout.engine")
    except KeyError:
        raise ValueError(f"rollout.engine: unknown engine {name!r} (choose from {sorted(ENGINES)}, "
                         "or give 'package.module:factory')") from None
    return factory(**kwargs)
