"""Building the policy: process groups first, then the policy on them.

    groups = init_parallel("configs/tiny_cpu.yaml")       # torch.distributed + megatron's groups, once per process
    policy = load_policy("configs/tiny_cpu.yaml", groups)  # or a Config, a ModelConfig or a HF checkpoint dir

`init_parallel` initializes torch.distributed (torchrun's or a one-process group), megatron's TP/EP/DP groups and
its per-rank RNG tracker. `load_policy` builds the megatron-core MoE policy on the groups it is given, its
initial weights drawn from a forked RNG seeded with the config's seed (the caller's RNG state is left as it was),
and loads (and shards) HF weights when given a checkpoint. It initializes nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_gspo.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from moe_gspo.model import hf_io
from moe_gspo.parallel.state import init_model_parallel


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


def init_parallel(path_or_config, parallel: ParallelConfig | None = None, seed: int | None = None):
    """torch.distributed and megatron's groups for the model and layout of `path_or_config` (as load_policy takes
    it; `parallel` overrides its layout), megatron's RNG tracker seeded with `seed` (default: the config's);
    returns megatron's ProcessGroupCollection for load_policy and the trainer."""
    mc, pc, cfg_seed, ckpt = _resolve(path_or_config)
    pc = parallel or pc
    if ckpt is not None:
        mc = hf_io.model_config_from_hf(ckpt, mc)
    return init_model_parallel(pc, mc.num_experts, seed=cfg_seed if seed is None else seed,
                               num_kv_heads=mc.num_key_value_heads, vocab_size=mc.vocab_size)


def load_policy(path_or_config, groups, parallel: ParallelConfig | None = None, seed: int | None = None):
    """Build the policy on `groups` (init_parallel's). `path_or_config`: Config, ModelConfig, a YAML path or a HF
    checkpoint dir of one of the families; `parallel` overrides its layout, which must match the groups' sizes."""
    from moe_gspo.model.policy import MoEPolicy

    mc, pc, cfg_seed, ckpt = _resolve(path_or_config)
    pc = parallel or pc
    if (pc.tp, pc.ep) != (groups.tp.size(), groups.ep.size()):
        raise ConfigError(f"parallel.tp={pc.tp}, parallel.ep={pc.ep} do not match the process groups "
                          f"(tp={groups.tp.size()}, ep={groups.ep.size()}): call init_parallel with this layout")
    seed = cfg_seed if seed is None else seed
    hf_state = None
    if ckpt is not None:  # read and check everything before building anything
        mc = hf_io.model_config_from_hf(ckpt, mc)
        hf_state = hf_io.read_safetensors_dir(ckpt)
    recompute = {}
    if isinstance(path_or_config, Config):  # train.recompute shapes the layers megatron builds
        recompute = dict(recompute=path_or_config.train.recompute,
                         recompute_layers=path_or_config.train.recompute_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = MoEPolicy(mc, pc, groups, **recompute)
    if hf_state is not None:
        try:
            policy.load_hf_state(hf_state)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{ckpt}: {e}") from None
    return policy
