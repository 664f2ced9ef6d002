"""megarl.config: typed config tree, YAML composition, dotted overrides, validation.

    cfg = load_config("configs/recipes/qwen2.5-32b/dapo.yaml", ["actor.lr=1e-6"])
    validate_world(cfg, world_size)      # at process-group init / launch
    validate_model(cfg, hf_config)       # once the HF config is known
    save_config(cfg, f"{cfg.trainer.run_dir}/config.yaml")
"""

from megarl.config.loader import (
    ConfigError,
    compose,
    config_to_dict,
    field_docs,
    from_dict,
    load_config,
    parse_override,
    save_config,
)
from megarl.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    EvalConfig,
    MegaRLConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    SftConfig,
    TrainerConfig,
    doc_field,
)
from megarl.config.validate import (
    data_parallel_size,
    expected_world_size,
    validate_config,
    validate_model,
    validate_world,
)

__all__ = [
    "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "EvalConfig", "MegaRLConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "RolloutConfig", "SftConfig", "TrainerConfig",
    "compose", "config_to_dict", "data_parallel_size", "doc_field", "expected_world_size",
    "field_docs", "from_dict", "load_config", "parse_override", "save_config", "validate_config",
    "validate_model", "validate_world",
]
