"""Typed config: YAML composition, dotted overrides, type checks, validation messages."""

from __future__ import annotations

import os
import textwrap

import pytest
import yaml

from megarl.config import (
    ConfigError,
    MegaRLConfig,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
    validate_model,
    validate_world,
)
from megarl.config.cli import dump_defaults, explain, main as config_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path, text: str) -> str:
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def errors_of(excinfo) -> str:
    return str(excinfo.value)


# ----------------------------------------------------------------------------- overrides


def test_override_values_are_typed():
    cfg = load_config(None, [
        "actor.lr=3e-6",                # YAML 1.1 reads this as a string; float fields accept it
        "actor.lr_warmup_steps=7",
        "data.shuffle=false",
        "model.load=null",
        "data.eval=[configs/eval/a.yaml, {name: b, path: x.jsonl}]",
        "trainer.run_dir=/tmp/run 1",
        "reward.correct_score=2",       # free-form mapping
        "reward.new_key=[1, 2]",
    ])
    assert cfg.actor.lr == 3e-6 and isinstance(cfg.actor.lr, float)
    assert cfg.actor.lr_warmup_steps == 7
    assert cfg.data.shuffle is False
    assert cfg.model.load is None
    assert cfg.data.eval == ["configs/eval/a.yaml", {"name": "b", "path": "x.jsonl"}]
    assert cfg.trainer.run_dir == "/tmp/run 1"
    assert cfg.reward == {"correct_score": 2, "incorrect_score": -1.0, "new_key": [1, 2]}


def test_parse_override_rejects_malformed():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a.b=") == ("a.b", None)
    for bad in ("novalue", "=3", "a..b=1", "a.b=[1, 2"):
        with pytest.raises(ConfigError):
            parse_override(bad)


def test_defaults_match_the_documented_base_yaml():
    assert load_config(None) == MegaRLConfig()
    assert load_config(os.path.join(REPO, "configs", "base.yaml")) == MegaRLConfig()
    # and base.yaml is exactly what the generator writes (docs stay in sync with the schema)
    with open(os.path.join(REPO, "configs", "base.yaml")) as f:
        assert f.read() == dump_defaults(), "regenerate: python -m megarl.config --dump-defaults > configs/base.yaml"


# ----------------------------------------------------------------------------- composition


def test_defaults_compose_relative_to_the_file_and_later_wins(tmp_path):
    write(tmp_path / "base.yaml", """
        actor: {lr: 1.0e-6, weight_decay: 0.0}
        rollout: {n_samples_per_prompt: 8, temperature: 0.9}
    """)
    write(tmp_path / "layouts" / "two.yaml", """
        parallel: {tp: 2, nodes: 2}
        rollout: {temperature: 0.7}
    """)
    recipe = write(tmp_path / "recipes" / "r.yaml", """
        defaults: [../base.yaml, ../layouts/two.yaml]
        actor: {lr: 2.0e-6}
    """)
    extra = write(tmp_path / "other" / "x.yaml", "parallel: {tp: 4}\n")
    cfg = load_config(recipe)
    assert cfg.actor.lr == 2e-6            # the file overrides its defaults
    assert cfg.actor.weight_decay == 0.0   # mappings merge recursively
    assert cfg.rollout.temperature == 0.7  # later default overrides earlier
    assert cfg.rollout.n_samples_per_prompt == 8
    assert (cfg.parallel.tp, cfg.parallel.nodes) == (2, 2)
    cfg = load_config([recipe, extra], ["parallel.nodes=4"])
    assert (cfg.parallel.tp, cfg.parallel.nodes) == (4, 4)  # files left to right, then overrides


def test_lists_are_replaced_not_merged(tmp_path):
    a = write(tmp_path / "a.yaml", "data: {eval: [x.yaml, y.yaml]}\n")
    b = write(tmp_path / "b.yaml", "defaults: [a.yaml]\ndata: {eval: [z.yaml]}\n")
    assert load_config(b).data.eval == ["z.yaml"]
    assert load_config(a).data.eval == ["x.yaml", "y.yaml"]


def test_missing_and_circular_defaults_are_reported(tmp_path):
    a = write(tmp_path / "a.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert "nope.yaml" in errors_of(e) and "a.yaml" in errors_of(e)
    write(tmp_path / "c1.yaml", "defaults: [c2.yaml]\n")
    c2 = write(tmp_path / "c2.yaml", "defaults: [c1.yaml]\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(c2)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path / "l.yaml", "- 1\n- 2\n"))


# ----------------------------------------------------------------------------- errors


def test_unknown_keys_name_the_field_the_file_and_a_suggestion(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        actor: {lr: 1.0e-6, learning_rat: 3}
        rollout: {temprature: 0.5}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(recipe, ["actor.clip_high=0.3", "bogus.x=1"])
    msg = errors_of(e)
    assert f"actor.learning_rat (from {recipe}): unknown key" in msg
    assert "rollout.temprature" in msg and "did you mean 'rollout.temperature'" in msg
    # a key that belongs to another section points there
    assert "actor.clip_high (from override 'actor.clip_high=0.3')" in msg
    assert "did you mean 'algorithm.clip_high'" in msg
    assert "bogus (from override 'bogus.x=1'): unknown key" in msg
    assert len(e.value.errors) == 4  # every problem is reported at once


def test_type_errors_name_the_field_expected_type_and_doc(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        actor: {lr: fast}
        rollout: {n_samples_per_prompt: 2.5, fire: "yes"}
        parallel: 8
    """)
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    msg = errors_of(e)
    assert f"actor.lr (from {recipe}): got str 'fast'; expected float" in msg and "peak learning rate" in msg
    assert "rollout.n_samples_per_prompt" in msg and "expected int" in msg
    assert "rollout.fire" in msg and "expected bool" in msg
    assert "parallel (from" in msg and "expected a mapping" in msg


def test_enum_values_are_checked_with_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.loss_agg=mean", "model.fp8=e5m2"])
    msg = errors_of(e)
    with pytest.raises(ConfigError) as e2:  # registry names are checked with the cross-field rules
        load_config(None, ["algorithm.advantage=grop"])
    assert "algorithm.advantage" in errors_of(e2) and "did you mean 'grpo'" in errors_of(e2)
    assert "['egae', 'gae', 'gpg', 'grpo', 'opo', 'reinforce_pp', 'reinforce_pp_baseline', 'remax', 'rloo']" in errors_of(e2)
    assert "algorithm.loss_agg" in msg and "model.fp8" in msg


@pytest.mark.parametrize(
    "overrides, field, text",
    [
        (["algorithm.clip_c=1.0"], "algorithm.clip_c", "> 1"),
        (["algorithm.gamma=1.5"], "algorithm.gamma", "[0, 1]"),
        (["algorithm.lam_actor=-0.1"], "algorithm.lam_actor", "[0, 1]"),
        (["algorithm.advantage=gae"], "critic.enable", "needs a critic"),
        (["algorithm.advantage=egae", "critic.enable=false"], "critic.enable", "needs a critic"),
        (["algorithm.mini_batch_size=500"], "algorithm.mini_batch_size", "8192"),
        (["model.sequence_parallel=true"], "model.sequence_parallel", "tp > 1"),
        (["model.moe_aux_loss_coeff=-0.01"], "model.moe_aux_loss_coeff", "must be >= 0"),
        (["rollout.window=8192"], "rollout.window", "unknown"),
        (["eval.every=5"], "eval.every", "unknown"),
        (["model.logprob_chunk_tokens=0"], "model.logprob_chunk_tokens", "must be >= 1"),
        (["algorithm.policy_loss=nope"], "algorithm.policy_loss", "vanilla_pg"),
        (["algorithm.advantage=nope"], "algorithm.advantage", "package.module:function"),
        (["algorithm.kl_target=0.1"], "algorithm.kl_target", "kl_in_reward=true"),
        (["algorithm.overlong_max_len=30000"], "algorithm.overlong_max_len", "rollout.max_new_tokens=20480"),
        (["algorithm.overlong_penalty=true", "rollout.max_new_tokens=4096"], "algorithm.overlong_cache_len",
         "L_max=4096"),
        (["actor.offload_optimizer=true", "actor.use_distributed_optimizer=false"], "actor.offload_optimizer",
         "use_distributed_optimizer"),
        (["rollout.function=notdotted"], "rollout.function", "package.module:function"),
        (["algorithm.length_adaptive_alpha=0.05"], "algorithm.length_adaptive_alpha", "GAE"),
        (["actor.max_tokens_per_microbatch=8192"], "actor.max_tokens_per_microbatch", "22528"),
        (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
        (["parallel.vpp=2"], "parallel.vpp", "pp > 1"),
        (["model.fp8=e4m3", "model.transformer_impl=local"], "model.fp8", "transformer_engine"),
        (["algorithm.advantage=rloo", "rollout.n_samples_per_prompt=1", "algorithm.mini_batch_size=512"],
         "rollout.n_samples_per_prompt", ">= 2"),
    ],
)
def test_cross_field_validation_names_the_field(overrides, field, text):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = errors_of(e)
    assert field in msg and text in msg, msg


def test_loader_refuses_a_layout_that_cannot_divide_its_world(tmp_path):
    layout = write(tmp_path / "layouts" / "bad.yaml", "parallel: {tp: 3, nodes: 1, gpus_per_node: 8}\n")
    with pytest.raises(ConfigError) as e:
        load_config(layout)
    assert f"parallel.tp (from {layout}): tp*pp*cp = 3*1*1 = 3 does not divide the world" in errors_of(e)
    assert load_config(layout, ["parallel.gpus_per_node=6"]).parallel.tp == 3


def test_validation_error_names_the_file_that_set_the_value(tmp_path):
    recipe = write(tmp_path / "r.yaml", "algorithm: {gamma: 2.0}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert f"algorithm.gamma (from {recipe}): must be in [0, 1], got 2.0" in errors_of(e)


def test_validate_world_and_model():
    cfg = load_config(None, ["parallel.tp=4", "parallel.pp=2", "parallel.rollout_tp=4", "algorithm.mini_batch_size=512"])
    validate_world(cfg, 8)
    validate_world(cfg, 64)
    with pytest.raises(ConfigError, match=r"tp\*pp\*cp = 4\*2\*1 = 8 does not divide the world size 12"):
        validate_world(cfg, 12)
    small_mb = load_config(None, ["algorithm.mini_batch_size=4", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="cannot feed data-parallel size 8"):
        validate_world(small_mb, 8)

    qwen7b = {"num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "intermediate_size": 18944}
    validate_model(load_config(None, ["parallel.tp=4", "parallel.pp=2", "parallel.rollout_tp=2"]), qwen7b)
    with pytest.raises(ConfigError) as e:
        validate_model(load_config(None, ["parallel.tp=8", "parallel.pp=3", "parallel.nodes=3", "parallel.rollout_tp=8"]), qwen7b)
    msg = errors_of(e)
    assert "num_attention_heads=28 is not divisible by tp=8" in msg
    assert "num_key_value_heads=4 is not divisible by tp=8" in msg
    assert "num_hidden_layers=28 is not divisible by pp*vpp=3" in msg
    assert "rollout_tp=8" in msg
    with pytest.raises(ConfigError, match="needs an MoE model"):
        validate_model(load_config(None, ["parallel.ep=2"]), qwen7b)
    for field in ("algorithm.routing_replay", "model.freeze_router"):  # MoE-only switches on a dense model
        with pytest.raises(ConfigError, match=f"{field}.*dense model"):
            validate_model(load_config(None, [f"{field}=true"]), qwen7b)


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["actor.lr=5e-7", "data.eval=[a.yaml]", "reward.extra=1", "critic.enable=true",
                             "algorithm.advantage=gae"])
    path = str(tmp_path / "run" / "config.yaml")
    save_config(cfg, path)
    with open(path) as f:
        assert yaml.safe_load(f)["actor"]["lr"] == 5e-7
    assert load_config(path) == cfg
    assert config_to_dict(cfg)["critic"]["lr"] == 2e-6


def test_explain_and_cli(capsys):
    text = explain("algorithm.clip_c")
    assert text.startswith("algorithm.clip_c: float or null = null") and "dual-clip" in text
    assert "actor.lr: float" in explain("actor")
    with pytest.raises(ConfigError):
        explain("actor.nope")
    assert config_main(["actor.lr=2e-6"]) == 0
    assert "lr: 2.0e-06" in capsys.readouterr().out
    assert config_main(["actor.lr=abc"]) == 2
    assert "actor.lr" in capsys.readouterr().err
