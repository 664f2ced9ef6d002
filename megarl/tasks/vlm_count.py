"""Quickstart task for vision-language models: count the red squares in a generated image.

An image is a `grid` x `grid` board of `cell`-pixel cells on a white background; some cells hold
one filled square (a side of `min_side`..`max_side` pixels at a random offset inside its cell,
whose last pixel row and column stay blank, so no two squares touch) in one of `COLORS`. Each
colour's count is drawn uniformly from 0..`max_count`, so the answer to "How many <colour>
squares?" is uniform over 0..max_count whatever the other colours (the distractors) do. The
questions name the `asked` colours: red only by default; all three makes the model read the
question too, and learn more slowly (module doc of tools/research/probe_vlm_task.py has the figures).
With the tiny VLM's patch 4 and 2x2 merge (`megarl.tasks.tiny_vlm`) one image token covers one
8-pixel cell, so the default 6 x 6 board (48 x 48 pixels) is 36 image tokens.

Prompt row (train / eval)::

    {"id": "vlm_count-eval-0", "problem": "<image>\nHow many red squares?\n",
     "images": ["images/eval-0.png"], "answer": "3", "data_source": "vlm_count"}

image paths are relative to the jsonl file and ``<image>`` marks where the image goes. SFT rows add
``prompt`` (the problem text, for template ``raw``) and ``response`` = ``"Answer: <n>"``, which the
math verifier scores like the text tasks. Splits never share an image.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarl.config import MegaRLConfig
from megarl.tasks import QUICKSTART_TASKS, QuickstartTask

TASK_NAME = DATA_SOURCE = "vlm_count"
COLORS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220)}
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class CountSpec:
    """The board and the question: sizes in pixels, `asked` the colours questions name."""

    grid: int = 6
    cell: int = 8
    min_side: int = 4
    max_side: int = 7
    max_count: int = 6
    asked: tuple[str, ...] = ("red",)

    def __post_init__(self):
        if not 1 <= self.min_side <= self.max_side < self.cell:
            raise ValueError(f"vlm_count: need 1 <= min_side <= max_side < cell, got {self.min_side}, "
                             f"{self.max_side}, {self.cell}")
        if len(COLORS) * self.max_count > self.grid**2:
            raise ValueError(f"vlm_count: {len(COLORS)} colours x max_count {self.max_count} squares do not fit "
                             f"a {self.grid}x{self.grid} board")
        if not self.asked or set(self.asked) - set(COLORS):
            raise ValueError(f"vlm_count: asked colours {self.asked} must be a non-empty subset of {list(COLORS)}")


@dataclass(frozen=True)
class Example:
    """One image (uint8 [H, W, 3]) with its question colour and answer."""

    image: np.ndarray
    color: str
    count: int

    @property
    def problem(self) -> str:
        return f"<image>\nHow many {self.color} squares?\n"

    @property
    def response(self) -> str:
        return f"Answer: {self.count}"


def draw_board(rng: random.Random, spec: CountSpec) -> tuple[np.ndarray, dict[str, int]]:
    """A random board and its count per colour."""
    counts = {c: rng.randint(0, spec.max_count) for c in COLORS}
    cells = rng.sample(range(spec.grid**2), sum(counts.values()))
    size = spec.grid * spec.cell
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    colors = [c for c, n in counts.items() for _ in range(n)]
    for cell, color in zip(cells, colors):
        side = rng.randint(spec.min_side, spec.max_side)
        y = (cell // spec.grid) * spec.cell + rng.randint(0, spec.cell - 1 - side)
        x = (cell % spec.grid) * spec.cell + rng.randint(0, spec.cell - 1 - side)
        image[y:y + side, x:x + side] = COLORS[color]
    return image, counts


def make_examples(rng: random.Random, spec: CountSpec, n: int, seen: set[str]) -> list[Example]:
    """`n` examples on boards whose pixels are not in `seen` (which gains their hashes)."""
    out: list[Example] = []
    while len(out) < n:
        image, counts = draw_board(rng, spec)
        key = hashlib.sha1(image.tobytes()).hexdigest()
        if key in seen:
            continue
        seen.add(key)
        color = rng.choice(spec.asked)
        out.append(Example(image=image, color=color, count=counts[color]))
    return out


def write_task_files(out_dir: str | Path, n_sft: int, n_train: int, n_eval: int, seed: int,
                     spec: CountSpec = CountSpec()) -> dict[str, Path]:
    """Write ``images/<split>-<i>.png`` and ``sft.jsonl``, ``train.jsonl``, ``eval.jsonl`` (rows as
    the module docstring shows) into `out_dir`; the splits' images are pairwise distinct."""
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(seed), set()
    paths = {}
    for split, n in (("eval", n_eval), ("train", n_train), ("sft", n_sft)):
        paths[split] = out / f"{split}.jsonl"
        with paths[split].open("w", encoding="utf-8") as f:
            for i, ex in enumerate(make_examples(rng, spec, n, seen)):
                image = f"images/{split}-{i}.png"
                Image.fromarray(ex.image).save(out / image)
                row = {"id": f"{TASK_NAME}-{split}-{i}", "problem": ex.problem, "images": [image],
                       "answer": str(ex.count)}
                if split == "sft":
                    row |= {"prompt": ex.problem, "response": ex.response}
                else:
                    row["data_source"] = DATA_SOURCE
                f.write(json.dumps(row) + "\n")
    return paths


def write_quickstart_files(out_dir: Path, cfg: MegaRLConfig) -> None:
    """The quickstart's split sizes (12000 SFT, 4000 train, 200 eval) at the run's seed."""
    write_task_files(out_dir, n_sft=12000, n_train=4000, n_eval=200, seed=cfg.trainer.seed)


QUICKSTART_TASKS.register(TASK_NAME)(QuickstartTask(write_files=write_quickstart_files))
