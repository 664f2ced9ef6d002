"""MoE training through the trainer on megatron-core, 4 gloo ranks (strict device mode), one launch
(tests/distributed/scripts_moe_train.py): the same actor updates at TP1xEP1, TP1xEP2 and TP2xEP2
(sequence parallelism with megarl's RMSNorm), router freezing, and routing replay (R3) against the
builtin engine's recorded experts, including one step of the RL loop."""

import math

import pytest

from tests.distributed.launch import worker_fixture

result = worker_fixture("scripts_moe_train.py", 4, timeout=900, name="result")


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", ["tp1_ep2", "tp2_ep2"])
def test_expert_parallel_update_equals_ep1(result, layout):
    ref, got = result["layouts"]["tp1_ep1"], result["layouts"][layout]
    assert ref["microbatches"] > 1  # gradient accumulation over packed micro-batches
    assert max(abs(a - b) for x, y in zip(got["old_logprobs"], ref["old_logprobs"]) for a, b in zip(x, y)) < 1e-5
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], abs=1e-6)  # the first update moved the policy
    for key in ("losses", "grad_norms"):  # grad norm over dense + expert grads (EP, expert-DP, TP/SP)
        for g, r in zip(got[key], ref[key]):
            assert math.isfinite(r) and rel(g, r) < 1e-5, (layout, key, g, r)
    # clip_grad=0.05 < grad norm: the clipped Adam updates of every streamed HF tensor agree
    assert ref["grad_norms"][0] > 0.05
    assert got["n_tensors"] > 50 and got["weights_max_rel_diff"] < 1e-4


def test_dense_sequence_parallel_on_the_local_spec(result):
    """megarl's RMSNorm lets the local spec run sequence parallelism (dense too): TP2+SP == TP1."""
    d = result["dense_sp"]
    assert d["tp2_sequence_parallel"] and not d["tp1_sequence_parallel"]
    for key in ("losses", "grad_norms"):
        for g, r in zip(d["tp2"][key], d["tp1"][key]):
            assert math.isfinite(r) and rel(g, r) < 1e-5, (key, g, r)


def test_frozen_router_stays_bit_identical_while_experts_train(result):
    f = result["freeze"]
    assert f["gates"] == 2 and f["gates_identical"] and f["router_params_trainable"] == 0
    assert f["experts_changed"] == f["experts"] == 36 and f["grad_norm"] > 0


def test_load_balancing_loss_is_configurable(result):
    """model.moe_aux_loss_coeff > 0 adds megatron's load-balancing loss (its gradient reaches the
    routers): the first update's grad norm differs from the aux-free one, and by loss type."""
    base = result["layouts"]["tp1_ep2"]["grad_norms"][0]
    aux = result["aux_loss"]
    assert rel(aux["aux_loss"], base) > 1e-3 and rel(aux["global_aux_loss"], base) > 1e-3
    assert rel(aux["aux_loss"], aux["global_aux_loss"]) > 1e-4  # DP-global token counts


def test_replay_on_same_weights_matches_engine_logprobs(result):
    r = result["replay"]["same_weights_tp2_ep2"]
    assert r["tokens"] > 40
    assert r["moe/replayed_fraction"] == 1.0 and r["moe/routing_agreement"] == 1.0
    assert r["logprob_max_abs_diff"] < 1e-5  # engine log-probs == trainer log-probs (TP2xEP2, SP)


def test_replay_makes_the_trainer_route_like_the_engine(result):
    r = result["replay"]
    off, on = r["perturbed_tp1_ep2_off"], r["perturbed_tp1_ep2_on"]
    # the perturbed router genuinely disagrees with the engine; this script's own hooks agree
    assert off["moe/routing_agreement"] < 0.9
    assert off["own_used_equal_engine"] == pytest.approx(off["moe/routing_agreement"], abs=1e-12)
    assert "moe/replayed_fraction" not in off
    # with replay every (token, layer, slot) the routers used is the engine's, read independently
    assert on["own_used_equal_engine"] == 1.0 and on["moe/replayed_fraction"] == 1.0
    assert on["moe/routing_agreement"] < 0.9  # the metric still measures the native mismatch
    assert r["perturbed_tp2_ep2_on"]["moe/replayed_fraction"] == 1.0  # SP split over TP ranks
    # full activation recompute replays the same experts in the backward
    for case in ("perturbed_tp1_ep2_on_recompute", "perturbed_pp2_ep2_on_recompute",  # PP2: 1F1B
                 "perturbed_cp2_ep2_on"):  # CP2: the experts of each rank's chunks
        rc = r[case]
        assert rc["moe/replayed_fraction"] == 1.0
        assert rel(rc["loss"], on["loss"]) < 1e-5 and rel(rc["grad_norm"], on["grad_norm"]) < 1e-5, case


def test_rl_step_logs_routing_agreement(result):
    rows = result["loop"]["rows"]
    assert len(rows) == 1
    m = rows[0]
    assert m["moe/replayed_fraction"] == 1.0
    assert 0.0 <= m["moe/routing_agreement"] <= 1.0
    assert m["rollout/logprob_mismatch_max"] < 1e-4
