"""Code PRM end to end on 2 gloo ranks (TP=2; tests/distributed/scripts_prm.py): binary-search
labelling with real engines and sandbox tests, PRM training, the critic initialised from the PRM
checkpoint, and the PRM's dense line rewards as the RL loop computes them."""

import math

import pytest

from tests.distributed.launch import run_worker, tiny_model

K, PROMPTS, SAMPLES, STEPS = 2, 6, 2, 12


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from megarl.tasks.code_lines import write_task_files

    root = tmp_path_factory.mktemp("prm")
    tiny_model(root / "model")
    task = write_task_files(root / "task", n_sft=256, n_train=16, n_eval=2, seed=0)
    overrides = [
        f"model.hf_path={root / 'model'}", f"data.train_path={task['train']}", f"sft.data_path={task['sft']}",
        f"prm.path={root / 'prm'}", f"prm.label_k={K}", f"prm.label_prompts={PROMPTS}",
        f"prm.label_samples={SAMPLES}", f"prm.train_steps={STEPS}", "prm.batch_size=4", "sft.batch_size=32",
        "sft.lr=3e-3", "sft.lr_warmup_steps=2", "critic.lr=3e-3",
    ]
    return run_worker("scripts_prm.py", 2, root, "--sft-steps", 40, config="quickstart/code_prm.yaml",
                      overrides=overrides)


def test_labels_come_from_binary_searches_with_k_completions_per_prefix(result):
    lab = result["stats"]["labels"]
    assert lab["responses"] == PROMPTS * SAMPLES  # prm.label_prompts x prm.label_samples, over both ranks
    assert lab["completions"] == K * lab["oracle_calls"]  # prm.label_k per queried prefix
    assert lab["searched"] > 0 and lab["oracle_calls"] <= lab["max_oracle_calls"]  # <= ceil(log2 n) each
    assert lab["lines"] > 0 and 0 <= lab["positive_lines"] <= lab["lines"]


def test_prm_fits_its_labels(result):
    fit = result["stats"]["fit"]
    assert fit["steps"] == STEPS
    assert fit["after"]["train"]["mse"] < fit["before"]["train"]["mse"]
    assert result["reused"]  # ensure_prm found the complete checkpoint and did not retrain
    assert result["stats"]["policy"].endswith("sft") and "another_policy" in result["other_policy_error"]
    assert "prm.path" in result["other_policy_error"]  # a PRM of another policy is refused, not reused


def test_critic_initialised_from_the_prm_starts_with_its_values(result):
    assert result["critic_vs_prm_max_diff"] == 0.0
    assert result["actor_critic_vs_prm_max_diff"] > 1e-4  # without prm.init_critic: a fresh value head


def test_dense_rewards_sit_on_line_ends_with_lambda_over_n_lines(result):
    assert result["scorer_with_dense_reward"] and not result["scorer_without_dense_reward"]  # prm.dense_reward
    newline = set(result["newline_ids"])
    assert newline == {10}  # byte tokenizer: only "\n"
    for ids, acc, v, r in zip(result["response_ids"], result["acc"], result["prm_values"], result["dense"]):
        ends = [t for t, tok in enumerate(ids[:-1]) if tok in newline]
        lam = 0.025 if acc else 0.25
        expect = [0.0] * len(r)
        for e in ends:
            expect[e] = lam * v[e + 1] / len(ends)
        assert r == pytest.approx(expect, abs=1e-7)
        assert not math.isclose(sum(abs(x) for x in r), 0.0)
