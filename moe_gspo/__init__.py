"""moe-gspo: MoE policy training for RL of language models (GSPO vs GRPO, Routing Replay, expert flips).

Public entry points:
    moe_gspo.load_policy(path_or_config) -> policy module (logits [B, T, V] from input_ids [B, T])
    moe_gspo.losses.get_policy_loss(name)
    moe_gspo.kernels.token_logprobs(hidden, weight, targets, ...)
    moe_gspo.routing.flip_rate(old_idx, new_idx)
"""

from moe_gspo.parallel.megatron_notices import quiet_missing_backends

__version__ = "0.1.0"

quiet_missing_backends()  # before any moe_gspo module imports megatron


def load_policy(path_or_config, **kwargs):
    """Build the megatron-core Qwen3-MoE policy from a HF checkpoint dir, a YAML path or a config object."""
    from moe_gspo.model.load import load_policy as _load

    return _load(path_or_config, **kwargs)


__all__ = ["load_policy", "__version__"]
