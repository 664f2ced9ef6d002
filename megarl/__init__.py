"""megarl: RL post-training for reasoning LLMs on megatron-core."""

__version__ = "0.1.0"
