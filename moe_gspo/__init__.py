"""moe-gspo: MoE policy training for RL of language models (GSPO vs GRPO, Routing Replay, expert flips).

Public entry points:
    groups = moe_gspo.init_parallel(path_or_config)      # torch.distributed + megatron's groups, once per process
    moe_gspo.load_policy(path_or_config, groups) -> policy module (logits [B, T, V] from input_ids [B, T])
    moe_gspo.losses.get_policy_loss(name)
    moe_gspo.kernels.token_logprobs(hidden, weight, targets, ...)
    moe_gspo.routing.flip_rate(old_idx, new_idx)
"""

from moe_gspo.parallel.megatron_notices import quiet_missing_backends

__version__ = "0.1.0"

quiet_missing_backends()  # before any moe_gspo module imports megatron


def init_parallel(path_or_config, **kwargs):
    """torch.distributed and megatron's process groups for a config (moe_gspo.model.load.init_parallel)."""
    from moe_gspo.model.load import init_parallel as _init

    return _init(path_or_config, **kwargs)


def load_policy(path_or_config, groups, **kwargs):
    """Build the megatron-core MoE policy of the config's family on `groups` from a HF checkpoint dir, a YAML path
    or a config object (moe_gspo.model.load.load_policy)."""
    from moe_gspo.model.load import load_policy as _load

    return _load(path_or_config, groups, **kwargs)


__all__ = ["init_parallel", "load_policy", "__version__"]
