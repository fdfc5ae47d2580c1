"""Typed configuration: dataclasses with a docstring per field, values from YAML plus `a.b=value` overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["train.lr=1e-3", "parallel.ep=2"])

Every check names the field and the bad value; unknown keys and wrong types fail before anything is built.
The sections live in model.py (model, parallel), algorithm.py, run.py (rollout, train, logging, the whole Config,
compare); load.py reads YAML and overrides, hf_config.py a checkpoint's config.json.
"""

from moe_gspo.config.algorithm import AlgorithmConfig
from moe_gspo.config.checks import ConfigError, UserError
from moe_gspo.config.load import (apply_overrides, compare_config_from_dict, config_from_dict, load_config, read_yaml,
                                  to_dict)
from moe_gspo.config.model import ModelConfig, ParallelConfig
from moe_gspo.config.run import CompareConfig, Config, LoggingConfig, RolloutConfig, TrainConfig

__all__ = [
    "AlgorithmConfig", "CompareConfig", "Config", "ConfigError", "LoggingConfig", "ModelConfig", "ParallelConfig",
    "RolloutConfig", "TrainConfig", "apply_overrides", "compare_config_from_dict", "config_from_dict",
    "UserError", "load_config", "read_yaml", "to_dict",
]
