"""The two layouts of fused expert tensors in HF checkpoints, told apart from the file itself.

Some HF families keep all experts of a layer in two tensors, `...mlp.experts.gate_up_proj` and
`...mlp.experts.down_proj` (expert g at index g of dim 0). Two layouts exist on disk:

| layout          | gate_up_proj          | down_proj    | who writes it                                   |
| ---             | ---                   | ---          | ---                                             |
| `released`      | [E, H, 2I] (x @ W_g)  | [E, I, H]    | Qwen3-VL-MoE releases, transformers 4.x, megarl |
| `transformers5` | [E, 2I, H] (W_g @ x)  | [E, H, I]    | transformers >= 5 `save_pretrained`             |

(H hidden size, I expert FFN size; the gate rows come before the up rows in both.) transformers 5
transposes on load and writes its in-memory layout back, so a model fine-tuned with transformers
and saved again holds the second layout. megarl's bridge works in `released`; `HFCheckpoint`
presents a `transformers5` file transposed, so every reader sees one layout.

Which layout a checkpoint holds (`fused_expert_layout`), in this order:
1. every layer that has both tensors decides by their shapes alone: released means gate_up
   [E, a, b] and down [E, c, d] with a = d and b = 2c; transformers5 means b = c and a = 2d. The
   two cannot both hold (b = 2c and b = c would need I = 0), so a complete checkpoint is always
   decided here, even where H = 2I makes gate_up's shape the same in both layouts;
2. a tensor alone, against config.json's hidden size H and expert FFN size I, when its shape fits
   only one layout (gate_up: H != 2I; down: H != I);
3. otherwise config.json's `transformers_version`: 5 or later -> transformers5, else released.
Layers that disagree are an error naming two of them.

Only qwen3_vl_moe's bridge and builtin engine work on fused tensors (`FUSED_EXPERT_FAMILIES`); for
every other family `HFCheckpoint` presents fused tensors per expert (`per_expert_views`): the
released Qwen3.5-MoE checkpoints are fused ([E, 2I, H], as vLLM's Qwen3.5-MoE loader splits them)
while transformers 5 writes the same model per expert.
"""

from __future__ import annotations

from typing import Mapping

RELEASED, TRANSFORMERS5 = "released", "transformers5"
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
FUSED_EXPERT_FAMILIES = ("qwen3_vl_moe",)  # config.json model_type whose readers take fused tensors


class ExpertLayoutError(ValueError):
    """The fused expert tensors of a checkpoint do not agree on one layout."""


def is_fused_expert(name: str) -> bool:
    return name.endswith((GATE_UP, DOWN))


def _text_config(config: Mapping | None) -> Mapping:
    config = config or {}
    return config.get("text_config") or config


def _lone_votes(name: str, shape: tuple[int, ...], config: Mapping | None) -> set[str]:
    """Layouts a single tensor's shape fits, given config.json's H and I (both when unknown)."""
    text = _text_config(config)
    h, i = text.get("hidden_size"), text.get("moe_intermediate_size")
    if h is None or i is None or len(shape) != 3:
        return {RELEASED, TRANSFORMERS5}
    released, transposed = ((h, 2 * i), (2 * i, h)) if name.endswith(GATE_UP) else ((i, h), (h, i))
    return {lay for lay, want in ((RELEASED, released), (TRANSFORMERS5, transposed)) if tuple(shape[1:]) == want}


def _pair_vote(gate_up: tuple[int, ...], down: tuple[int, ...]) -> str | None:
    if len(gate_up) != 3 or len(down) != 3:
        return None
    (_, a, b), (_, c, d) = gate_up, down
    if a == d and b == 2 * c:
        return RELEASED
    if b == c and a == 2 * d:
        return TRANSFORMERS5
    return None


def version_layout(config: Mapping | None) -> str:
    """The layout transformers of config.json's `transformers_version` writes (released if unknown)."""
    version = str((config or {}).get("transformers_version") or "")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return RELEASED
    return TRANSFORMERS5 if major >= 5 else RELEASED


def fused_expert_layout(shapes: Mapping[str, tuple[int, ...]], config: Mapping | None = None) -> str | None:
    """The layout of the fused expert tensors among `shapes` (name -> on-disk shape; module doc
    for the rules), None when there are none. Raises ExpertLayoutError when layers disagree."""
    fused = {n: tuple(s) for n, s in shapes.items() if is_fused_expert(n)}
    if not fused:
        return None
    decided: dict[str, str] = {}  # layout -> a tensor that showed it
    undecided = []
    for name, shape in fused.items():
        if not name.endswith(GATE_UP):
            if name[: -len(DOWN)] + GATE_UP not in fused:
                undecided.append(name)
            continue
        down = name[: -len(GATE_UP)] + DOWN
        vote = _pair_vote(shape, fused[down]) if down in fused else None
        if vote is None:
            undecided.append(name)
        else:
            decided.setdefault(vote, name)
    for name in undecided:
        votes = _lone_votes(name, fused[name], config)
        if len(votes) == 1:
            decided.setdefault(votes.pop(), name)
    if len(decided) > 1:
        raise ExpertLayoutError(
            f"fused expert tensors in two layouts: {decided[RELEASED]} is [E, H, 2I] / [E, I, H] (released), "
            f"{decided[TRANSFORMERS5]} is [E, 2I, H] / [E, H, I] (transformers >= 5 save_pretrained)")
    return next(iter(decided)) if decided else version_layout(config)


def released_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The released-layout shape of a transformers5-layout fused expert tensor (dims 1, 2 swapped)."""
    return (shape[0], shape[2], shape[1])


def per_expert_views(fused: str, experts: int) -> dict[str, tuple[str, int, int, int]]:
    """The per-expert names of one fused tensor, each -> (fused name, expert, part, parts): gate_up_proj
    gives `{e}.gate_proj.weight` (part 0 of 2) and `{e}.up_proj.weight` (part 1), down_proj
    `{e}.down_proj.weight`, under the fused tensor's `...mlp.experts.` prefix."""
    base, kind = fused.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return {f"{base}.{e}.{p}.weight": (fused, e, k, len(parts)) for e in range(experts) for k, p in enumerate(parts)}
