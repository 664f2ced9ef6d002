"""Which FP8 recipes a GPU runs, by Transformer Engine 2.11's own rules, checked when a model is built.

TE asserts its support rules inside the first FP8 autocast of a forward
(transformer_engine/pytorch/quantization.py: `check_fp8_support`, `check_fp8_block_scaling_support`,
`check_mxfp8_support`, called by `check_recipe_support`), deep in a training step. The same rules,
as a pure function of the GPU's compute capability and torch's CUDA version, refuse the recipe when
the model is built, naming `model.fp8_recipe`:

| model.fp8_recipe | TE recipe | runs on |
| --- | --- | --- |
| delayed, tensorwise | DelayedScaling, Float8CurrentScaling | sm >= 9.0; sm 8.9 (Ada) with CUDA >= 12.1 |
| blockwise | Float8BlockScaling | sm >= 9.0 with CUDA >= 12.9 |
| mxfp8 | MXFP8BlockScaling | sm 10.x (datacenter Blackwell); TE refuses 12.0+ "yet" |

On Ada TE also wants cuBLASLt >= 12.1.3, which only TE can read; that case is left to TE.
"""

from __future__ import annotations

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _cuda(version: str | None) -> tuple[int, int]:
    if not version:
        return (0, 0)
    major, _, minor = version.partition(".")
    return int(major), int((minor.split(".")[0] or "0"))


def unsupported_reason(recipe: str, capability: tuple[int, int], cuda: str | None) -> str | None:
    """Why `recipe` cannot run on a GPU of compute `capability` under torch CUDA `cuda` ("12.9"),
    or None when it can."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r} (choose from {list(RECIPES)})")
    sm = f"sm {capability[0]}.{capability[1]}"
    if recipe == "mxfp8":
        if capability >= (12, 0):
            return f"MXFP8 is not supported on compute capability 12.0+ yet (Transformer Engine 2.11); this GPU is {sm}"
        if capability >= (10, 0):
            return None
        return (f"MXFP8 block scaling needs compute capability 10.x (Blackwell: B200 / GB200); this GPU is {sm} "
                "(Hopper: use delayed, tensorwise or blockwise)")
    if recipe == "blockwise":
        if capability >= (9, 0) and _cuda(cuda) >= (12, 9):
            return None
        return (f"FP8 block scaling needs compute capability >= 9.0 and CUDA >= 12.9; this GPU is {sm} "
                f"with CUDA {cuda or 'none'}")
    if capability >= (9, 0):
        return None
    if capability < (8, 9):
        return f"FP8 needs compute capability >= 8.9 (Ada, Hopper, Blackwell); this GPU is {sm}"
    if _cuda(cuda) < (12, 1):
        return f"FP8 on Ada (sm 8.9) needs CUDA >= 12.1; torch has CUDA {cuda or 'none'}"
    return None


def check_fp8_recipe(recipe: str) -> None:
    """Raises ValueError naming model.fp8_recipe when this process's GPU cannot run `recipe` (no
    GPU: nothing to check; FP8 needs Transformer Engine, which needs CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return
    reason = unsupported_reason(recipe, torch.cuda.get_device_capability(), torch.version.cuda)
    if reason is not None:
        raise ValueError(f"model.fp8_recipe={recipe}: {reason}")
