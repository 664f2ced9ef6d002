"""The vlm_count quickstart task: answers recounted from the PNG pixels, disjoint splits, paths that
resolve, well-formed rows that megarl's data layer and math verifier accept."""

import json
import random
from collections import deque

import numpy as np
import pytest
from PIL import Image

from megarl.data import load_prompt_dataset
from megarl.data.dataset import tokenize_dataset
from megarl.data.images import ImageInputs
from megarl.rewards.math import is_correct
from megarl.tasks import quickstart_task
from megarl.tasks.tiny_vlm import TinyVLMSpec, build_image_processor, build_vlm_tokenizer
from megarl.tasks.vlm_count import COLORS, CountSpec, draw_board, make_examples, write_task_files

PROBLEM = "<image>\nHow many {} squares?\n"


def count_squares(pixels: np.ndarray, rgb: tuple[int, int, int]) -> int:
    """Connected (4-neighbour) regions of exactly `rgb`, each checked to be a filled square."""
    mask = (pixels == np.array(rgb, dtype=np.uint8)).all(-1)
    seen = np.zeros_like(mask)
    regions = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        regions += 1
        seen[y0, x0] = True
        todo, cells = deque([(y0, x0)]), []
        while todo:
            y, x = todo.popleft()
            cells.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
        ys, xs = zip(*cells)
        h, w = max(ys) - min(ys) + 1, max(xs) - min(xs) + 1
        assert h == w and h * w == len(cells), "a region is not a filled square"
    return regions


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm_count")
    write_task_files(out, n_sft=120, n_train=80, n_eval=60, seed=3)
    return out


def rows(task_dir, split):
    return [json.loads(line) for line in (task_dir / f"{split}.jsonl").read_text().splitlines()]


def test_boards_match_their_counts():
    rng, spec = random.Random(0), CountSpec()
    for _ in range(200):
        image, counts = draw_board(rng, spec)
        assert image.shape == (48, 48, 3) and image.dtype == np.uint8
        assert {c: count_squares(image, rgb) for c, rgb in COLORS.items()} == counts
        assert all(0 <= n <= spec.max_count for n in counts.values())
        painted = (image != 255).any(-1)
        assert painted.sum() == sum(((image == rgb).all(-1)).sum() for rgb in COLORS.values())


def test_questions_name_the_asked_colours():
    rng = random.Random(1)
    assert {ex.color for ex in make_examples(rng, CountSpec(), 50, set())} == {"red"}
    many = make_examples(rng, CountSpec(asked=tuple(COLORS)), 200, set())
    assert {ex.color for ex in many} == set(COLORS)
    for ex in many:
        assert ex.problem == PROBLEM.format(ex.color) and ex.response == f"Answer: {ex.count}"
        assert count_squares(ex.image, COLORS[ex.color]) == ex.count


def test_answers_recounted_from_the_png_files(task_dir):
    answers = []
    for split in ("sft", "train", "eval"):
        for row in rows(task_dir, split):
            color = next(c for c in COLORS if row["problem"] == PROBLEM.format(c))
            pixels = np.asarray(Image.open(task_dir / row["images"][0]).convert("RGB"))
            assert row["answer"] == str(count_squares(pixels, COLORS[color]))
            answers.append(int(row["answer"]))
    assert set(answers) == set(range(CountSpec().max_count + 1))  # every answer occurs


def test_rows_are_well_formed_and_paths_resolve(task_dir):
    for split, n in (("sft", 120), ("train", 80), ("eval", 60)):
        got = rows(task_dir, split)
        assert len(got) == n and len({r["id"] for r in got}) == n
        for r in got:
            assert r["problem"].count("<image>") == 1 and len(r["images"]) == 1
            assert not r["images"][0].startswith("/") and (task_dir / r["images"][0]).is_file()
            assert r["answer"].isdigit()
            if split == "sft":
                assert set(r) == {"id", "prompt", "response", "images", "problem", "answer"}
                assert r["prompt"] == r["problem"] and r["response"] == f"Answer: {r['answer']}"
                assert is_correct(r["response"], r["answer"])
                assert not is_correct(r["response"], str(int(r["answer"]) + 1))
            else:
                assert set(r) == {"id", "problem", "images", "answer", "data_source"}
                assert r["data_source"] == "vlm_count"


def test_splits_share_no_image(task_dir):
    digests = {}
    for split in ("sft", "train", "eval"):
        digests[split] = {Image.open(task_dir / r["images"][0]).tobytes() for r in rows(task_dir, split)}
        assert len(digests[split]) == len(rows(task_dir, split))
    assert not (digests["sft"] & digests["train"] or digests["sft"] & digests["eval"]
                or digests["train"] & digests["eval"])


def test_same_seed_same_files(task_dir, tmp_path):
    write_task_files(tmp_path, n_sft=120, n_train=80, n_eval=60, seed=3)
    for split in ("sft", "train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (task_dir / f"{split}.jsonl").read_text()
    assert (tmp_path / "images" / "eval-7.png").read_bytes() == (task_dir / "images" / "eval-7.png").read_bytes()


def test_prompt_rows_load_through_megarl_data_with_36_image_tokens(task_dir):
    tok = build_vlm_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
    images = ImageInputs(build_image_processor(TinyVLMSpec()), ids["<|image_pad|>"], ids["<|vision_start|>"],
                         ids["<|vision_end|>"], tok)
    data = tokenize_dataset(load_prompt_dataset(str(task_dir / "eval.jsonl")), tok, template="raw",
                            max_prompt_len=96, images=images)
    assert len(data) == 60 and not data.skipped and not data.too_long
    for item in data:
        p = item.prompt_ids
        assert p.count(ids["<|image_pad|>"]) == 36
        assert p[0] == ids["<|vision_start|>"] and p[37] == ids["<|vision_end|>"]
        assert tok.decode(p[38:]) == "\n" + item.prompt.split("\n", 1)[1]
    px = images.pixels(data[0].images)
    assert tuple(px.pixel_values.shape) == (144, 96) and px.image_grid_thw.tolist() == [[1, 12, 12]]


def test_registered_as_quickstart_task():
    task = quickstart_task("vlm_count")
    assert task.before_rl is None and task.table_metrics == ()


def test_bad_spec_is_refused():
    with pytest.raises(ValueError, match="max_side < cell"):
        CountSpec(max_side=8)
    with pytest.raises(ValueError, match="do not fit"):
        CountSpec(grid=3, max_count=4)
    with pytest.raises(ValueError, match="subset"):
        CountSpec(asked=("purple",))
