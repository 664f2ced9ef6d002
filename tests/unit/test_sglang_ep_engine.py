"""SGLang engines with attention data parallelism and expert parallelism, possibly over several
nodes (rollout.sglang_dp_size / sglang_ep_size, parallel.rollout_tp > gpus_per_node): the server
arguments (field names as in SGLang's ServerArgs: enable_dp_attention, dp_size, ep_size, nnodes,
node_rank, dist_init_addr), which experts each engine GPU hosts (what the weight sync sends it), and
the per-round lockstep of an update whose ranks get different tensors. The multi-node start and the
lockstep across ranks: tests/distributed/test_rollout_groups.py."""

import pytest

from megarl.config import ConfigError, load_config, validate_model
from megarl.rollout.sglang.requests import engine_experts, lockstep, server_args, with_last_flag


def test_server_args_for_dp_attention_ep_and_engines_over_nodes():
    base = ["rollout.engine=sglang", "parallel.rollout_tp=16", "parallel.gpus_per_node=8", "parallel.nodes=2",
            "data.max_prompt_len=512",
            "rollout.max_new_tokens=1024", "eval.max_new_tokens=1024"]
    args = server_args(load_config(None, base + ["rollout.sglang_dp_size=16", "rollout.sglang_ep_size=16"]))
    assert args == {"tp_size": 16, "mem_fraction_static": 0.6, "context_length": 1536, "enable_dp_attention": True,
                    "dp_size": 16, "ep_size": 16, "nnodes": 2}
    plain = server_args(load_config(None, ["parallel.rollout_tp=4"]))
    assert not {"enable_dp_attention", "dp_size", "ep_size", "nnodes"} & set(plain)
    for field, value in (("sglang_dp_size", 3), ("sglang_ep_size", 5), ("sglang_dp_size", 0)):
        with pytest.raises(ConfigError, match=rf"rollout\.{field}"):
            load_config(None, base + [f"rollout.{field}={value}"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang_server_args.*ep_size \(rollout\.sglang_ep_size\)"):
        load_config(None, ["rollout.sglang_server_args={ep_size: 8}"])


def test_engines_over_nodes_dp_attention_and_ep_are_sglangs_and_checked_against_the_model():
    over = ["parallel.rollout_tp=16", "parallel.gpus_per_node=8", "parallel.nodes=2"]
    with pytest.raises(ConfigError, match=r"parallel\.rollout_tp.*only rollout\.engine=sglang"):
        load_config(None, over)  # the builtin engine runs inside one node
    with pytest.raises(ConfigError, match=r"part of one node or whole nodes"):
        load_config(None, ["rollout.engine=sglang", "parallel.rollout_tp=12", "parallel.gpus_per_node=8",
                           "parallel.nodes=3"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang_dp_size.*rollout\.engine is 'builtin'"):
        load_config(None, ["parallel.rollout_tp=4", "rollout.sglang_dp_size=2"])
    cfg = load_config(None, ["rollout.engine=sglang", "parallel.rollout_tp=8", "rollout.sglang_dp_size=8",
                             "rollout.sglang_ep_size=8"])
    # attention data parallelism splits heads over rollout_tp / dp = 1 GPU: 4 KV heads and 12 heads are fine
    validate_model(cfg, {"num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 2,
                         "num_experts": 16})
    with pytest.raises(ConfigError, match=r"num_attention_heads=12 is not divisible by rollout_tp=8"):
        validate_model(load_config(None, ["rollout.engine=sglang", "parallel.rollout_tp=8"]),
                       {"num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match=r"rollout\.sglang_ep_size.*num_experts=12"):
        validate_model(cfg, {"num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 2,
                             "num_experts": 12})
    with pytest.raises(ConfigError, match=r"rollout\.sglang_ep_size.*num_experts=None"):
        validate_model(cfg, {"num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 2})


def test_deepep_all_to_all_needs_deep_ep_installed():
    from types import SimpleNamespace

    from megarl.rollout.sglang.engine import SGLangEngine

    fake = SimpleNamespace(__version__="0.5.23", Engine=None)
    with pytest.raises(ImportError, match="DeepEP"):
        SGLangEngine("/nowhere", sglang_module=fake, moe_a2a_backend="deepep")
    with pytest.raises(FileNotFoundError, match="config.json"):  # without DeepEP the engine goes on to the model
        SGLangEngine("/nowhere", sglang_module=fake)


def test_each_engine_gpu_hosts_its_ep_ranks_experts():
    assert engine_experts(3, 8, 8, 128) == range(48, 64)  # one EP rank per GPU
    assert [engine_experts(r, 8, 4, 128) for r in (0, 1, 2, 7)] == [range(0, 32), range(0, 32), range(32, 64),
                                                                    range(96, 128)]  # 2 GPUs share an EP rank
    assert engine_experts(0, 8, 1, 64) == range(0, 64)
    with pytest.raises(ValueError, match="must divide"):
        engine_experts(0, 8, 3, 128)


def test_lockstep_without_a_group_is_the_stream_itself():
    buckets = [[("a", 1)], [("b", 2)]]
    assert list(lockstep(with_last_flag(buckets), None)) == [([("a", 1)], True), ([("b", 2)], False)]
    assert list(lockstep(with_last_flag([]), None)) == []
