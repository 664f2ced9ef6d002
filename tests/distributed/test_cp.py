"""Context parallelism on megatron-core with megarl's local attention, 4 gloo ranks (strict device
mode): a packed variable-length batch at CP=2, TP2xCP2 and PP2xCP2 gives CP=1's log-probs,
values, losses and grad norms; chunked log-probs / entropy equal the unchunked ones and the
textbook formulas."""

import math

import pytest

from tests.distributed.launch import rl_files, rl_overrides, run_worker


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rl_files(tmp_path_factory.mktemp("cp"), intermediate=96)
    overrides = rl_overrides(root) + [
        "algorithm.mini_batch_size=4", "eval.n_samples=1", "eval.max_new_tokens=12",
        "data.max_prompt_len=9", "rollout.max_new_tokens=23",
        "actor.max_tokens_per_microbatch=64", "critic.max_tokens_per_microbatch=64",
        "actor.lr=1e-3", "critic.lr=1e-3", "actor.lr_warmup_steps=0", "critic.lr_warmup_steps=0",
        "algorithm.entropy_coef=0.01", "parallel.nodes=1", "parallel.gpus_per_node=4",
    ]
    return run_worker("scripts_cp.py", 4, root, config="algorithms/ppo.yaml", overrides=overrides, timeout=900)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def max_abs(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("layout", ["tp1_pp1_cp2", "tp2_pp1_cp2", "tp1_pp2_cp2"])
def test_cp_layout_equals_cp1(result, layout):
    ref, got = result["tp1_pp1_cp1"], result[layout]
    assert ref["microbatches"] > 1  # the batch spans several packed micro-batches
    assert max_abs(got["old_logprobs"], ref["old_logprobs"]) < 1e-5
    assert max_abs(got["values"], ref["values"]) < 1e-5
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], abs=1e-7)  # the first update changed the policy
    for key in ("losses", "entropies", "grad_norms"):
        for g, r in zip(got[key], ref[key]):
            assert math.isfinite(r) and rel(g, r) < 1e-5, (layout, key, g, r)
    assert rel(got["critic_loss"], ref["critic_loss"]) < 1e-5
    assert rel(got["critic_grad_norm"], ref["critic_grad_norm"]) < 1e-5


def test_chunked_views_equal_unchunked_and_the_formulas(result):
    c = result["chunked"]
    ref = c["reference"]
    for chunk in ("4096", "3", "1"):
        assert max_abs(c[chunk]["logp"], ref["logp"]) < 1e-5, chunk
        assert max_abs(c[chunk]["ent"], ref["ent"]) < 1e-5, chunk
        assert rel(c[chunk]["grad_norm"], c["4096"]["grad_norm"]) < 1e-6, chunk
    assert c["4096"]["grad_norm"] > 0


def test_rl_loop_at_cp2_checkpoints_and_resumes_at_cp1(result):
    rows = [r for r in result["loop"]["rows"] if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/pg_loss", "critic/value_loss", "actor/grad_norm", "critic/grad_norm"):
            assert math.isfinite(r[key]) and (key == "actor/pg_loss" or r[key] > 0), (r["step"], key)
        # engine (weights streamed from the CP=2 / resumed CP=1 actor) vs trainer log-probs
        assert r["rollout/logprob_mismatch_max"] < 1e-4, r["step"]
