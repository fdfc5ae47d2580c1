"""Group-relative advantage estimators, registered by name.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      "grpo"         (GRPO and GSPO both use this)
    A_i =  r_i - mean_g(r)                          "grpo_no_std"  (Dr. GRPO style, no std scaling)

std is the POPULATION std (divide by G, `unbiased=False`), as in the worked example of docs/guide/method.md
(rewards [1, 0, 1, 0] -> std 0.5 -> A = [+1, -1, +1, -1] up to eps). A group whose rewards are all equal
(including a group of one) gets A = 0 exactly, never NaN.

Every estimator is `fn(rewards, group_ids=None, *, eps=1e-6) -> advantages` with
    rewards     [N] with group_ids [N] (any integer ids, groups need not be contiguous), or [num_groups, G]
    advantages  same shape as rewards, float (float64 stays float64, anything else becomes float32)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}


def register_advantage_estimator(name: str):
    """Decorator: register `fn` under `name` in ADVANTAGE_ESTIMATORS."""

    def deco(fn):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def get_advantage_estimator(name: str) -> Callable[..., Tensor]:
    """The estimator registered as `name`; an unknown name raises ValueError listing the valid ones."""
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}")
    return ADVANTAGE_ESTIMATORS[name]


def group_stats(rewards: Tensor, group_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(centered, std, all_equal), each the shape of rewards: r - group mean, population std, group is constant."""
    rewards = torch.as_tensor(rewards)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(f"rewards contains NaN or inf (first at index {bad})")
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(
                f"rewards must be [num_groups, G], or [N] with group_ids [N]; got shape {tuple(rewards.shape)}"
            )
        mean = rewards.mean(-1, keepdim=True)
        centered = rewards - mean
        std = centered.pow(2).mean(-1, keepdim=True).sqrt().expand_as(rewards)
        equal = (rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True)).expand_as(rewards)
        return centered, std, equal
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "with group_ids, rewards and group_ids must both be [N]; "
            f"got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # inv: (N,) group index 0..K-1
    zeros_K = rewards.new_zeros(uniq.numel())
    count_K = zeros_K.index_add(0, inv, torch.ones_like(rewards))
    mean_K = zeros_K.index_add(0, inv, rewards) / count_K
    centered = rewards - mean_K[inv]
    std_K = (zeros_K.index_add(0, inv, centered.pow(2)) / count_K).sqrt()
    max_K = zeros_K.scatter_reduce(0, inv, rewards, "amax", include_self=False)
    min_K = zeros_K.scatter_reduce(0, inv, rewards, "amin", include_self=False)
    return centered, std_K[inv], (max_K == min_K)[inv]


@register_advantage_estimator("grpo")
def grpo_advantage(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (population group std + eps); 0 for a group whose rewards are all equal."""
    centered, std, equal = group_stats(rewards, group_ids)
    return torch.where(equal, torch.zeros_like(centered), centered / (std + eps))


@register_advantage_estimator("grpo_no_std")
def grpo_no_std_advantage(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """r - group mean (no std scaling); 0 for a group whose rewards are all equal. `eps` is accepted and unused."""
    centered, _, equal = group_stats(rewards, group_ids)
    return torch.where(equal, torch.zeros_like(centered), centered)
