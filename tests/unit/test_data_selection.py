"""Pre-PPO prompt selection (per-domain z-scores, lowest kept), the math/code-first source
schedule (data.first_sources), and tools/select_prompts.py end to end on a tiny model."""

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.data.sampler import PromptSampler, SourceScheduleSampler, first_sources_share
from megarl.data.selection import domain_zscores, prompt_scores, select_hardest

REPO = Path(__file__).resolve().parents[2]


def test_prompt_scores_are_means():
    assert prompt_scores([[1, -1, 1, 1], [0.5], [-1, -1]]) == [0.5, 0.5, -1.0]
    with pytest.raises(ValueError, match="at least one"):
        prompt_scores([[1.0], []])


def test_domain_zscores_by_hand():
    # math: 1, 0, -1 -> mean 0, population std sqrt(2/3); code: 0.2, 0.6 -> mean 0.4, std 0.2; chat: constant
    z = domain_zscores([1, 0.2, 0, 0.6, -1, 0.7], ["math", "code", "math", "code", "math", "chat"])
    s = math.sqrt(2 / 3)
    assert z == pytest.approx([1 / s, -1.0, 0.0, 1.0, -1 / s, 0.0])


def test_select_hardest_uses_the_domain_normalised_score():
    # the two lowest raw scores are math's -1 and 0; within their domains the lowest are code's 0.1
    # (mean 0.25, std 0.0866: z = -1.73) and math's -1 (mean 0, std 0.816: z = -1.22)
    scores = [1, 0.1, 0, 0.3, -1, 0.3, 0.3]
    domains = ["math", "code", "math", "code", "math", "code", "code"]
    z = domain_zscores(scores, domains)
    assert z[1] == pytest.approx(-math.sqrt(3)) and z[4] == pytest.approx(-math.sqrt(1.5))
    assert z[1] < z[4] < min(z[i] for i in (0, 2, 3, 5, 6))
    assert select_hardest(scores, domains, 0.2) == [1, 4]  # ceil(0.2 * 7) = 2, file order
    assert select_hardest(scores, domains, 1.0) == list(range(7))
    with pytest.raises(ValueError, match="fraction"):
        select_hardest(scores, domains, 0.0)


def test_first_sources_share_schedules():
    assert [first_sources_share(s, 0.25, 4, "linear") for s in (0, 1, 2, 4, 9)] == [1.0, 0.8125, 0.625, 0.25, 0.25]
    assert [first_sources_share(s, 0.25, 4, "step") for s in (0, 3, 4, 9)] == [1.0, 1.0, 0.25, 0.25]
    with pytest.raises(ValueError, match="decay"):
        first_sources_share(0, 0.5, 4, "cosine")


@dataclass
class Item:
    uid: str
    data_source: str
    extra: dict = field(default_factory=dict)


def _items():
    return [Item(f"m{i}", "math") for i in range(6)] + [Item(f"c{i}", "code") for i in range(2)] \
        + [Item(f"g{i}", "general") for i in range(12)]


def test_source_schedule_batches_follow_the_share():
    s = SourceScheduleSampler(_items(), 8, seed=3, shuffle=True, first_sources=["math", "code"], steps=4, decay="linear")
    firsts = []
    for step in range(6):
        s.set_step(step)
        batch = s.next_batch()
        assert len(batch) == 8
        firsts.append(sum(x.data_source != "general" for x in batch))
    # natural share 8/20 = 0.4: round(8 * share) with share 1, 0.85, 0.7, 0.55, 0.4, 0.4
    assert firsts == [8, 7, 6, 4, 3, 3]


def test_source_schedule_resume_reproduces_the_stream():
    def run(n, sampler, start=0):
        out = []
        for step in range(start, start + n):
            sampler.set_step(step)
            out.append([x.uid for x in sampler.next_batch()])
        return out

    make = lambda: SourceScheduleSampler(_items(), 5, 1, True, ["math"], 3, "step")  # noqa: E731
    full = run(7, make())
    first = make()
    head = run(4, first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert head + run(3, resumed, start=4) == full
    assert all(uid.startswith("m") for b in full[:3] for uid in b)  # step decay: math only for 3 steps
    with pytest.raises(ValueError, match="written by another sampler"):
        PromptSampler(_items(), 5, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="without data.first_sources"):
        make().load_state_dict(PromptSampler(_items(), 5, 1).state_dict())


def test_source_schedule_needs_rows_in_and_outside_the_first_sources():
    with pytest.raises(ValueError, match=r"data.first_sources=\['math'\].*\['math'\]"):
        SourceScheduleSampler([Item("a", "math")] * 3, 2, 0, True, ["math"], 2, "linear")


def test_bad_schedule_config_fails_at_load():
    with pytest.raises(ConfigError, match="data.first_sources_steps"):
        load_config(None, ["data.first_sources=[math]"])
    with pytest.raises(ConfigError, match="data.first_sources_decay"):
        load_config(None, ["data.first_sources_decay=cosine"])


def answer_as_score(x, **_):
    """Test reward: the prompt's gold answer as a number (independent of the sampled text)."""
    return float(x.gold)


def test_select_prompts_tool_end_to_end(tmp_path):
    from megarl.tasks.tiny_model import TinyModelSpec, save_tiny_model

    model = save_tiny_model(tmp_path / "model", TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                                              intermediate=64))
    # 4 math prompts with scores 3, 1, 2, 6 and 3 code prompts with 10, 30, 20; one bad row
    rows = [{"problem": f"m{i}", "answer": str(v), "data_source": "math", "tag": i} for i, v in enumerate([3, 1, 2, 6])]
    rows += [{"problem": f"c{i}", "answer": str(v), "data_source": "code"} for i, v in enumerate([10, 30, 20])]
    cand = tmp_path / "cand.jsonl"
    cand.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n{oops\n"
                    + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    orig = tmp_path / "train.jsonl"
    orig.write_text(json.dumps({"problem": "o", "answer": "1"}) + "\n")
    out = tmp_path / "sel.jsonl"
    cmd = [sys.executable, str(REPO / "tools/select_prompts.py"), "--hf", model, "--candidates", cand,
           "--out", out, "--samples", 2, "--fraction", 0.3, "--merge-with", orig, "--batch-prompts", 3,
           "data.prompt_template=raw", "rollout.max_new_tokens=3", "rollout.temperature=1.0",
           f"reward.sources={{math: '{__name__}:answer_as_score', code: '{__name__}:answer_as_score'}}"]
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"problem": "o", "answer": "1"}  # merged original first, verbatim
    # z: math (3,1,2,6) mean 3 std sqrt(3.5) -> m1 z = -1.069; code (10,30,20) -> c0 z = -1.225;
    # ceil(0.3 * 7) = 3 kept: c0, m1 and m2 (z = -0.535), in file order
    kept = lines[1:]
    assert [k["problem"] for k in kept] == ["m1", "m2", "c0"]
    assert kept[0]["tag"] == 1 and kept[0]["id"] == "cand:2"  # original fields kept; uid from the row number
    assert kept[2]["pre_ppo_score"] == 10.0 and kept[2]["pre_ppo_z"] == pytest.approx(-math.sqrt(1.5))
    summary = json.loads((tmp_path / "sel.jsonl.summary.json").read_text())
    assert summary["skipped_rows"] == 1 and summary["kept"] == 3
    assert summary["by_source"]["math"] == {"candidates": 4, "kept": 2, "mean_score_all": 3.0, "mean_score_kept": 1.5}


def test_build_data_schedules_by_the_data_first_sources_fields(tmp_path):
    from megarl.tasks.tiny_model import build_byte_tokenizer
    from megarl.trainer.build import build_data

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{i}", "answer": "1", "data_source": "math" if i < 4 else "chat"})
                            + "\n" for i in range(16)))
    tok = build_byte_tokenizer()

    def math_counts(*overrides):
        cfg = load_config(None, [f"data.train_path={path}", "data.prompt_template=raw", "rollout.prompts_per_step=4", "algorithm.mini_batch_size=64",
                                 *overrides])
        sampler = build_data(cfg, tok).train
        out = []
        for step in range(4):
            sampler.set_step(step)
            out.append(sum(x.data_source == "math" for x in sampler.next_batch()))
        return out

    plain = math_counts()
    assert plain != [4, 4, 4, 4]  # shuffled natural mix (1/4 math)
    assert math_counts("data.first_sources=[math]", "data.first_sources_steps=2", "data.first_sources_decay=step") \
        == [4, 4, 1, 1]
    # linear: share 1, 0.625, 0.25, 0.25 of 4 prompts
    assert math_counts("data.first_sources=[math]", "data.first_sources_steps=2") == [4, 2, 1, 1]
    assert math_counts("data.first_sources=[math]", "data.first_sources_steps=3") == [4, 3, 2, 1]
