"""Native prompt rows (``id, problem, answer, data_source``) rewritten in the layouts other
frameworks ship, for tests/unit/test_data_formats.py and tests/distributed/scripts_data_formats.py.
Each writer returns the config overrides that read its output (configs/data/*.yaml hold the same
field mappings)."""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def verl_row(r: dict, i: int, images: list | None = None) -> dict:
    """verl's preprocessed row (examples/data_preprocess/gsm8k.py)."""
    row = {"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["problem"]}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"]},
           "extra_info": {"split": "train", "index": i, "question": r["problem"]}}
    if images is not None:
        row["images"] = images
    return row


def write_verl_parquet(rows: list[dict], path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([verl_row(r, i) for i, r in enumerate(rows)]), path)
    return [f"data.train_path={path}", "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth"]


def slime_row(r: dict) -> dict:
    """slime's JSONL row (--input-key prompt --label-key label --metadata-key metadata)."""
    return {"prompt": r["problem"], "label": r["answer"], "metadata": {"id": r["id"]},
            "data_source": r["data_source"]}


def write_slime_jsonl(rows: list[dict], path: Path) -> list[str]:
    path.write_text("".join(json.dumps(slime_row(r)) + "\n" for r in rows))
    return [f"data.train_path={path}", "data.prompt_key=prompt", "data.answer_key=label"]


def write_save_to_disk(rows: list[dict], path: Path) -> list[str]:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return [f"data.train_path={path}"]


def build_hf_cache(splits: dict[str, list[dict]], cache_dir: Path, name: str = "me/tiny-arith") -> str:
    """The cache entry `datasets.load_dataset(name)` leaves after a download, built locally: the
    packaged parquet builder prepares the splits under <cache_dir>/<namespace>___<name>/default/
    (the layout datasets' offline cache lookup reads). Returns the hf: spec of the train split."""
    import shutil

    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = cache_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(src / f"{split}.parquet"))
    short = name.split("/")[-1]
    files = DataFilesDict.from_patterns({s: [str(src / f"{s}.parquet")] for s in splits})
    builder = Parquet(cache_dir=str(cache_dir), dataset_name=short, data_files=files, hash="local")
    builder.download_and_prepare()
    (built,) = list((cache_dir / short).iterdir())  # default-<hash>: the name a hub download would not have
    target = cache_dir / name.replace("/", "___") / "default"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), str(target))
    shutil.rmtree(cache_dir / short)
    return f"hf:{name}?split=train"
