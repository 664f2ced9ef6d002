"""SGLang engines with attention data parallelism and expert parallelism, possibly over several
nodes (rollout.sglang_dp_size / sglang_ep_size, parallel.rollout_tp > gpus_per_node): the server
arguments (field names as in SGLang's ServerArgs: enable_dp_attention, dp_size, ep_size, nnodes,
node_rank, dist_init_addr), which experts each engine GPU hosts (what the weight sync sends it), and
the per-round lockstep of an update whose ranks get different tensors. The multi-node start and the
lockstep across ranks: tests/distributed/test_rollout_groups.py."""

import pytest

from megarl.config import ConfigError, load_config
from megarl.rollout.sglang.requests import engine_experts, lockstep, server_args, with_last_flag


def test_server_args_for_dp_attention_ep_and_engines_over_nodes():
    base = ["parallel.rollout_tp=16", "parallel.gpus_per_node=8", "parallel.nodes=2", "data.max_prompt_len=512",
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
