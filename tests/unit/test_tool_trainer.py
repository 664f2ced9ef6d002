"""Tool-calling rollouts in the trainer (megarl/trainer/tools.py + its hooks in generation / batch /
rl): the RolloutWorker runs the turns through a scripted engine and the real sandboxed interpreter,
scores the final answers, counts calls, errors, timeouts, malformed calls and budget ends, applies
the optional penalties; observation tokens get no loss, value target, advantage, KL or entropy,
and GAE passes through them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.rollout import Sample
from megarl.trainer import rl, tools
from megarl.trainer.batch import StepBatch, Trajectory

PRESET = "configs/algorithms/retool.yaml"
BASE = ["reward.sources={arith: math}", "rollout.max_new_tokens=200", "rollout.tools.max_response_tokens=400",
        "rollout.tools.timeout_s=4.0", "rollout.tools.max_turns=3"]


class ScriptedEngine:
    """generate() answers call k with script[k][j] for its j-th context (the byte tokenizer's ids;
    log-probs -0.5); every turn finishes "stop" (the format's stop string ends a calling turn)."""

    def __init__(self, tokenizer, script, routing: bool = False):
        self.tok, self.script, self.calls, self.routing = tokenizer, script, [], routing

    def generate(self, prompts, sampling):
        texts = self.script[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], sampling))
        assert len(texts) == len(prompts) * sampling.n
        out = []
        for j, text in enumerate(texts):
            ids = self.tok.encode(text, add_special_tokens=False)
            n = len(prompts[j // sampling.n]) + len(ids)  # MoE engines: experts of every token, 2 layers x top-2
            out.append(Sample(prompt_ids=list(prompts[j // sampling.n]), response_ids=ids, logprobs=[-0.5] * len(ids),
                              finish_reason="stop", text=text, index=j // sampling.n,
                              routed_experts=torch.ones(n, 2, 2, dtype=torch.int16) if self.routing else None))
        return out


CALL = "<code>\n{}\n</code>"
SCRIPT = [
    [CALL.format("print(6*7)"), "Answer: 41", CALL.format("raise ValueError('no')"),
     CALL.format("while True:\n    pass"), "oops </code>", CALL.format("x = 1")],
    ["Answer: 42", "Answer: 42", "Answer: 0", "Answer: 42", CALL.format("print(x)")],
    ["still calling " + CALL.format("print(2)")],
]


def run_worker(tmp_path, overrides=(), script=None, routing=False):
    import torch.distributed as dist

    from megarl.data.dataset import PromptItem
    from megarl.rollout import SamplingParams
    from megarl.tasks.tiny_model import build_byte_tokenizer
    from megarl.trainer.build import build_rewards
    from megarl.trainer.generation import RolloutWorker

    cfg = load_config(PRESET, BASE + list(overrides))
    tok = build_byte_tokenizer()
    script = SCRIPT if script is None else script
    engine = ScriptedEngine(tok, script, routing)
    worker = RolloutWorker(engine, tok, build_rewards(cfg), cfg)
    items = [PromptItem(uid=f"u{i}", prompt="6*7", answer="42", data_source="arith") for i in range(len(script[0]))]
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        rows = worker.generate(items, [tok.encode("Q: 6*7=?\n")] * len(items),
                               SamplingParams(n=1, max_new_tokens=200, seed=0))
        trajs = [worker.store.get(m.key) for m in rows]  # the payloads stay in the worker's store
    finally:
        if owned:
            dist.destroy_process_group()
    return trajs, worker.metrics, engine, tok


def test_tool_trajectories_keep_the_routed_experts(tmp_path):
    """Routing replay with tool calls: every trajectory carries the experts of each of its tokens
    (prompt, turns, observations), stitched from its turns' calls."""
    trajs, _, _, tok = run_worker(tmp_path, routing=True)
    for t in trajs:
        assert t.routed_experts is not None and t.routed_experts.shape == (t.length, 2, 2)
    assert run_worker(tmp_path, routing=False)[0][0].routed_experts is None


def test_worker_runs_the_turns_scores_the_answers_and_counts_every_outcome(tmp_path):
    trajs, m, engine, tok = run_worker(tmp_path)
    text = [tok.decode(t.response_ids) for t in trajs]
    assert "<interpreter>\n42\n</interpreter>" in text[0] and text[0].endswith("Answer: 42")
    assert "ValueError: no" in text[2] and "Error: timed out after 4 s" in text[3]
    assert "Error: </code> without an opening <code>" in text[4]
    assert "<interpreter>\n1\n</interpreter>" in text[5]  # turn 2 saw turn 1's x (state per trajectory)
    assert [t.acc for t in trajs] == [True, False, True, False, True, False]
    assert [t.tool_stats["end"] for t in trajs] == ["answer", "answer", "answer", "answer", "answer", "turn_budget"]
    assert [t.tool_stats["calls"] for t in trajs] == [1, 0, 1, 1, 1, 2] and trajs[4].tool_stats["malformed"] == 1
    for t in trajs:  # observation tokens: appended, log-prob 0, template_mask 1
        assert len(t.template_mask) == len(t.response_ids) == len(t.rollout_logprobs)
        assert all((lp == 0.0) == bool(mk) for lp, mk in zip(t.rollout_logprobs, t.template_mask))
    assert m["tools/calls_per_sample"] == pytest.approx(6 / 6) and m["tools/call_rate"] == pytest.approx(5 / 6)
    assert m["tools/python/calls_per_sample"] == pytest.approx(5 / 6) and m["tools/malformed_per_sample"] == pytest.approx(1 / 6)
    assert m["tools/python/error_rate"] == pytest.approx(1 / 5) and m["tools/python/timeout_rate"] == pytest.approx(1 / 5)
    assert m["tools/accuracy_with_call"] == pytest.approx(3 / 5) and m["tools/accuracy_without_call"] == 0.0
    assert m["tools/turn_budget_frac"] == pytest.approx(1 / 6) and m["tools/turns"] == pytest.approx(12 / 6)
    assert m["tools/obs_tokens"] == pytest.approx(sum(sum(t.template_mask) for t in trajs) / 6)
    assert all(c[1].stop == ["</code>"] for c in engine.calls)


def test_penalties_for_malformed_calls_and_the_turn_budget(tmp_path):
    base, _, _, _ = run_worker(tmp_path)
    pen, _, _, _ = run_worker(tmp_path, ["rollout.tools.malformed_penalty=0.5", "rollout.tools.budget_penalty=0.25"])
    assert [p.score - b.score for p, b in zip(pen, base)] == pytest.approx([0, 0, 0, 0, -0.5, -0.25])


def observation_batch(cfg_overrides=()) -> tuple[StepBatch, object]:
    """Two tool trajectories (response: turn, observation, turn) and one without a call."""
    cfg = load_config(PRESET, ["algorithm.whiten_advantages=false", *cfg_overrides])
    trajs = [Trajectory(uid="0", prompt_ids=[1, 2], response_ids=[5, 6, 7, 70, 71, 72, 8, 9], rollout_logprobs=[-.5] * 8,
                        finish_reason="stop", score=1.0, acc=True, template_mask=[0, 0, 0, 1, 1, 1, 0, 0], tool_stats={}),
             Trajectory(uid="0", prompt_ids=[1, 2], response_ids=[5, 70, 6], rollout_logprobs=[-.5] * 3,
                        finish_reason="stop", score=-1.0, template_mask=[0, 1, 0], tool_stats={}),
             Trajectory(uid="1", prompt_ids=[3], response_ids=[5, 6], rollout_logprobs=[-.5] * 2,
                        finish_reason="stop", score=-1.0, template_mask=[0, 0], tool_stats={})]
    batch = StepBatch.from_trajectories(trajs)
    rl.set_masks(batch, cfg)
    return batch, cfg


def test_observation_tokens_get_no_loss_value_or_advantage_and_gae_passes_through():
    batch, cfg = observation_batch()
    assert batch.turn_ends is None and batch.template_mask is not None
    obs = batch.template_mask
    assert torch.equal(batch.loss_mask, batch.response_mask * (1 - obs))
    assert torch.equal(batch.value_mask, batch.response_mask * (1 - obs))
    g = torch.Generator().manual_seed(0)
    batch.values = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.old_logprobs = batch.ref_logprobs = -torch.rand(batch.response_mask.shape, generator=g)
    rl.compute_advantages(batch, batch, [0, 1, 2], cfg, None, 0.0)
    assert torch.equal(batch.advantages * obs, torch.zeros_like(obs)) and torch.equal(batch.returns * obs, torch.zeros_like(obs))
    # gamma = lambda = 1: A_t = R - V_t at every generated token, whatever the values at the observation
    gen = batch.response_mask * (1 - obs)
    want = (batch.score[:, None] - batch.values) * gen
    assert torch.allclose(batch.advantages, want, atol=1e-6) and torch.allclose(batch.returns, batch.score[:, None] * gen)
    # gamma, lambda < 1: the same as GAE on the generated tokens alone (observations cut out)
    batch2, cfg2 = observation_batch(["algorithm.gamma=0.9", "algorithm.lam_actor=0.8", "algorithm.lam_critic=0.8"])
    batch2.values = batch.values.clone()
    rl.compute_advantages(batch2, batch2, [0, 1, 2], cfg2, None, 0.0)
    from megarl.algorithms.gae import compute_gae

    row = gen[0].bool()
    vals = batch.values[0, row][None]
    rew = torch.zeros_like(vals)
    rew[0, -1] = batch.score[0]
    adv, _ = compute_gae(rew, vals, torch.ones_like(vals), 0.9, 0.8)
    assert torch.allclose(batch2.advantages[0, row], adv[0], atol=1e-6)


def test_kl_in_reward_and_the_actor_losses_ignore_observation_tokens():
    batch, cfg = observation_batch(["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"])
    g = torch.Generator().manual_seed(1)
    batch.old_logprobs = -torch.rand(batch.response_mask.shape, generator=g)
    batch.ref_logprobs = -torch.rand(batch.response_mask.shape, generator=g)
    rewards, _ = rl.token_rewards(batch, cfg, 0.1, None)
    obs = batch.template_mask.bool()
    assert torch.equal(rewards[obs], torch.zeros(int(obs.sum())))  # no KL term where the policy sampled nothing

    cfg = load_config(PRESET, ["algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01", "algorithm.pos_lm_coef=0.0"])
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g)

    def loss(perturb: float):
        logp = batch.old_logprobs + perturb * batch.template_mask
        ent = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) + perturb * batch.template_mask
        data = SimpleNamespace(**{**batch.__dict__, "ref_logprobs": batch.ref_logprobs - perturb * batch.template_mask})
        mb = SimpleNamespace(data=data, log_probs=lambda logits, t: logp, entropy=lambda logits, t: ent)
        counts = rl.global_counts(batch, [0, 1, 2], None, batch.loss_mask)
        value, logs = rl.actor_loss_fn(cfg, counts, 1.0)(mb, None)
        return float(value), {k: float(v) for k, v in logs.items()}

    assert loss(0.0) == loss(3.0)  # log-prob, entropy and reference at the observations do not matter


def test_config_checks_name_the_field():
    for overrides, field in [(["rollout.tools.max_turns=0"], "rollout.tools.max_turns"),
                             (["rollout.tools.functions={f: a.b:c}"], "rollout.tools.functions"),
                             (["rollout.tools.python=false"], "rollout.tools.python"),
                             (["rollout.tools.malformed_penalty=-1"], "rollout.tools.malformed_penalty"),
                             (["rollout.tools.format=chat_json", "rollout.tools.python=false"], "rollout.tools.functions"),
                             (["rollout.tools.format=chat_json", "rollout.tools.functions={python: a.b:c}"],
                              "rollout.tools.functions"),
                             (["rollout.tools.max_response_tokens=100000"], "actor.max_tokens_per_microbatch")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(PRESET, overrides)


def test_chat_json_declares_the_tools_in_the_prompt():
    from megarl.data.templates import render_prompt
    from tests.unit.chat_templates import QWEN2_5, byte_tokenizer_with

    cfg = load_config(PRESET, ["rollout.tools.format=chat_json", "rollout.tools.functions={add: tests.unit.tool_fixtures:add}"])
    schemas = tools.tool_schemas(cfg)
    assert [s["function"]["name"] for s in schemas] == ["python", "add"]
    tok = byte_tokenizer_with(QWEN2_5)
    text = tok.decode(render_prompt("6*7", "raw", tok, True, schemas))
    assert '"name": "add"' in text and '"name": "python"' in text and text.endswith("<|im_start|>assistant\n")
    assert tools.tool_schemas(load_config(PRESET, [])) is None  # the code format declares nothing
    box = tools.build_toolbox(cfg)
    assert box.names == ["add", "python"]


STATE = [[CALL.format("x = 6\nprint('set')")], [CALL.format("print(x * 7)")], ["Answer: 42"]]


@pytest.mark.parametrize("field,value,check", [
    ("enable", "false", lambda t: t.tool_stats is None and t.template_mask is None),
    ("max_turns", "2", lambda t: (t.tool_stats["end"], t.tool_stats["turns"]) == ("turn_budget", 2)),
    ("max_response_tokens", "40", lambda t: t.tool_stats["end"] == "response_budget" and len(t.response_ids) <= 40),
    ("keep_state", "false", lambda t: "NameError: name 'x' is not defined" in t.tool_stats.get("text", "")),
])
def test_rollout_fields_change_the_trajectories(tmp_path, field, value, check):
    """Against the default (3 turns, a budget of 400, state kept: the second cell sees x), each field
    changes the trajectory of a sample that sets x, then prints x * 7, then answers."""
    (base,), _, _, tok = run_worker(tmp_path, script=STATE)
    (changed,), _, _, _ = run_worker(tmp_path, [f"rollout.tools.{field}={value}"], script=STATE)
    for t in (base, changed):
        if t.tool_stats is not None:
            t.tool_stats["text"] = tok.decode(t.response_ids)
    assert (base.tool_stats["end"], base.tool_stats["turns"], base.acc) == ("answer", 3, True)
    assert "<interpreter>\n42\n</interpreter>" in base.tool_stats["text"]
    assert check(changed) and not check(base)


def test_toolbox_follows_the_config():
    cfg = load_config(PRESET, ["rollout.tools.timeout_s=2.5", "rollout.tools.memory_mb=300", "rollout.tools.keep_state=false",
                               "rollout.tools.max_workers=3", "rollout.tools.max_output_chars=50"])
    box = tools.build_toolbox(cfg)
    py = box.tools["python"]
    assert (py.limits.timeout_s, py.limits.memory_mb, py.keep_state) == (2.5, 300, False)
    assert (box.max_workers, box.max_output_chars) == (3, 50)
    cfg = load_config(PRESET, ["rollout.tools.format=chat_json", "rollout.tools.python=false",
                               "rollout.tools.functions={add: tests.unit.tool_fixtures:add}"])
    assert tools.build_toolbox(cfg).names == ["add"] and [s["function"]["name"] for s in tools.tool_schemas(cfg)] == ["add"]
