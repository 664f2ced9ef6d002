"""Rewards: math verifier, code sandbox, generative judges, and hybrid routing by data source.

Heavy parts (math-verify workers, the sandbox, torch for GenRM) load on first use.
"""

from megarl.rewards.config import RewardConfig, RewardSpec
from megarl.rewards.manager import RewardManager
from megarl.rewards.registry import BuiltReward, register_reward
from megarl.rewards.types import RewardError, RewardInput, RewardOutput, RewardTimeout

__all__ = [
    "BuiltReward", "RewardConfig", "RewardError", "RewardInput", "RewardManager", "RewardOutput",
    "RewardSpec", "RewardTimeout", "register_reward",
]
