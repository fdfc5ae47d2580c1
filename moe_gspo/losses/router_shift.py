"""The router-shift weight of RSPO (arXiv:2510.23027): how far the router moved on the experts pi_old activated.

For token t of response i, with E^{l}_{i,t} the k experts the old policy activated in MoE layer l (of L) and
s^{l}(e) = log softmax(router logits)[e] the router score (the log-probability of expert e under the router's
softmax over all experts):

    gamma_{i,t}  = exp( -1/L sum_l 1/k sum_{e in E^l_{i,t}} | s^l_theta(e) - s^l_old(e) | )     in (0, 1]
    weight_{i,t} = sg[ max(gamma_{i,t}, floor) ]

The weight multiplies the token's importance ratio before the loss clips and aggregates it (registry.py). It is 1
exactly when the router scores did not move, and never below `floor` (the paper's lower bound), so a token whose
routing drifted is down-weighted, not dropped. It is a stop-gradient: no gradient reaches the router through it.

    gamma = router_shift_ratio(cur_NLK, old_NLK)          # (..., L, k) scores -> (...)
    w = router_shift_weight(gamma, floor=0.8)             # detached
    metrics = router_shift_metrics(gamma[mask], floor)    # moe/router_shift_{mean,p10,p90,min,floor_frac}
"""

from __future__ import annotations

import torch
from torch import Tensor


def router_shift_ratio(cur_scores: Tensor, old_scores: Tensor) -> Tensor:
    """gamma = exp(-mean over layers and the k old experts of |cur - old|): (..., L, k) x2 -> (...), detached.

    Scores are log-probabilities of the same experts in the same order in both tensors; computed in float32 or
    wider (float64 inputs stay float64)."""
    if cur_scores.shape != old_scores.shape or cur_scores.dim() < 2:
        raise ValueError(f"router scores must be (..., L, k) of one shape; got current {tuple(cur_scores.shape)} "
                         f"and old {tuple(old_scores.shape)}")
    dtype = torch.promote_types(torch.promote_types(cur_scores.dtype, old_scores.dtype), torch.float32)
    shift = (cur_scores.detach().to(dtype) - old_scores.detach().to(dtype)).abs().mean(dim=(-2, -1))
    return torch.exp(-shift)


def router_shift_weight(gamma: Tensor, floor: float) -> Tensor:
    """sg[max(gamma, floor)]: the weight the importance ratios are multiplied by; floor in (0, 1]."""
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"router-shift floor must be in (0, 1] (algorithm.router_shift_floor), got {floor}")
    return gamma.detach().clamp(min=floor)


def router_shift_metrics(gamma: Tensor, floor: float) -> dict[str, Tensor]:
    """Summary of the ratios gamma (1-D, response tokens only) before the floor: mean, 10th and 90th percentile,
    min, and the fraction of tokens the floor lifts. 0-dim detached tensors; all 1 (fraction 0) when empty."""
    g = gamma.detach().reshape(-1).float()
    if g.numel() == 0:
        one = torch.ones((), device=g.device)
        return {"moe/router_shift_mean": one, "moe/router_shift_p10": one, "moe/router_shift_p90": one,
                "moe/router_shift_min": one, "moe/router_shift_floor_frac": torch.zeros((), device=g.device)}
    q = torch.quantile(g, torch.tensor([0.1, 0.9], device=g.device))
    return {"moe/router_shift_mean": g.mean(), "moe/router_shift_p10": q[0], "moe/router_shift_p90": q[1],
            "moe/router_shift_min": g.min(), "moe/router_shift_floor_frac": (g < floor).float().mean()}
