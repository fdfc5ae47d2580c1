"""`load_policy`: one call from a config, a YAML file or a HF checkpoint dir to a ready policy module.

Initializes torch.distributed (torchrun or a one-process group) and megatron's TP/EP groups, builds the
megatron-core Qwen3-MoE policy on this rank, and loads (and shards) HF weights when given a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_gspo.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from moe_gspo.model import hf_io
from moe_gspo.parallel.state import init_parallel


def _resolve(path_or_config) -> tuple[ModelConfig, ParallelConfig, int, Path | None]:
    if isinstance(path_or_config, Config):
        cfg = path_or_config
        ckpt = Path(cfg.model.init_from) if cfg.model.init_from else None
        return cfg.model, cfg.parallel, cfg.train.seed, ckpt
    if isinstance(path_or_config, ModelConfig):
        ckpt = Path(path_or_config.init_from) if path_or_config.init_from else None
        return path_or_config, ParallelConfig(), 0, ckpt
    p = Path(path_or_config)
    if p.is_dir():
        return ModelConfig(init_from=str(p)), ParallelConfig(), 0, p
    if p.suffix in (".yaml", ".yml"):
        cfg = load_config(p)
        return _resolve(cfg)
    raise ConfigError(f"load_policy: {p} is neither a checkpoint directory nor a YAML config")


def load_policy(path_or_config, parallel: ParallelConfig | None = None, seed: int | None = None):
    """Build the policy. `path_or_config`: Config, ModelConfig, a YAML path or a HF Qwen3-MoE checkpoint dir."""
    from moe_gspo.model.policy import MoEPolicy

    mc, pc, cfg_seed, ckpt = _resolve(path_or_config)
    pc = parallel or pc
    seed = cfg_seed if seed is None else seed
    hf_state = None
    if ckpt is not None:  # read and check everything before building anything
        mc = hf_io.model_config_from_hf(ckpt, mc)
        hf_state = hf_io.read_safetensors_dir(ckpt)
    init_parallel(pc, mc.num_experts, seed=seed, num_kv_heads=mc.num_key_value_heads, vocab_size=mc.vocab_size)
    torch.manual_seed(seed)
    policy = MoEPolicy(mc, pc)
    if hf_state is not None:
        try:
            policy.load_hf_state(hf_state)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{ckpt}: {e}") from None
    return policy
