"""SAPO (arXiv:2511.20347) and CISPO (arXiv:2506.13585): two stabilizers that keep every token's gradient.

Per response token, with r = exp(clamp(logp - old_logp, -C, C)) and advantage A (one per response [B], or per
token [B, T]):

    sapo:   l_{i,t} = -(4 / tau) * sigmoid(tau * (r - 1)) * A,     tau = tau_pos if A > 0 else tau_neg
    cispo:  l_{i,t} = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp

SAPO replaces PPO's hard clip with a soft gate: its gradient is PPO's unclipped one, -A r grad logp, times
4 s (1 - s) with s = sigmoid(tau (r - 1)), which is 1 on-policy (r = 1) and decays smoothly as r leaves 1;
tau_neg > tau_pos makes the decay faster for negative advantages (the paper's defaults 1.0, 1.05). It does not
clip: its `pg_clipfrac` reports the tokens whose ratio lies outside [1 - clip_low, 1 + clip_high] (default
(0.2, 0.28), a PPO band for comparison), and `sapo_grad_scale_mean` the mean of 4 s (1 - s) over response tokens.
Aggregation default: seq-mean-token-mean (per response, then averaged, as the paper).

CISPO is REINFORCE with a clipped, detached importance weight: no token loses its gradient, a far-off token only
has its weight capped. Default (eps_low, eps_high) = (1.0, 0.28): no lower bound (MiniMax-M1 sets eps_low large
and tunes only eps_high), upper 1.28 (DAPO's clip-higher value). `pg_clipfrac` is the fraction of response tokens
whose weight was capped (their gradient is scaled, not zeroed). Aggregation default: token-mean (the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import agg_loss
from moe_gspo.losses.policy import _frac, surrogate_metrics
from moe_gspo.losses.registry import LossConfigError, PolicyLoss, register_policy_loss

SAPO_TAU = (1.0, 1.05)  # (tau_pos, tau_neg), arXiv:2511.20347
SAPO_BAND = (0.2, 0.28)  # the PPO band SAPO's pg_clipfrac diagnostic measures against; SAPO itself does not clip
CISPO_CLIP = (1.0, 0.28)  # no lower bound; upper 1 + 0.28


def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg_mode: str,
    loss_denominator: Tensor | float | None,
    log_ratio_clamp: float,
    tau_pos: float = SAPO_TAU[0],
    tau_neg: float = SAPO_TAU[1],
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO's soft-gated surrogate; advantages [B] or [B, T]; tau_pos, tau_neg > 0."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) or (B, 1)
    ratio = torch.exp((logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp))  # (B, T)
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))  # in the loss's dtype
    gate = torch.sigmoid(tau * (ratio - 1.0))
    pg_losses = -(4.0 / tau) * gate * adv
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, loss_denominator)
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    scale = (4.0 * gate * (1.0 - gate)).detach()
    return pg_loss, surrogate_metrics(
        pg_loss, logp, old_logp, mask, ratio, mask, _frac(outside, mask),
        sapo_grad_scale_mean=torch.where(mask, scale, 0).sum() / mask.sum().clamp(min=1))


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg_mode: str,
    loss_denominator: Tensor | float | None,
    log_ratio_clamp: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logp per token; advantages [B] or [B, T]."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp((logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp)).detach()  # (B, T)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses = -weight * adv * logp
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, loss_denominator)
    return pg_loss, surrogate_metrics(pg_loss, logp, old_logp, mask, ratio, mask, _frac(weight != ratio, mask))


@dataclass(frozen=True)
class SAPOOptions:
    tau_pos: float = SAPO_TAU[0]
    """Gate temperature for positive advantages (> 0)."""
    tau_neg: float = SAPO_TAU[1]
    """Gate temperature for negative advantages (> 0; larger decays the gradient of off-policy tokens faster)."""

    def __post_init__(self):
        for field in ("tau_pos", "tau_neg"):
            v = getattr(self, field)
            if not (isinstance(v, (int, float)) and v > 0):
                raise LossConfigError(f"loss_options.{field}", v, "sapo's gate temperatures must be > 0")


@register_policy_loss
class SAPO(PolicyLoss):
    """SAPO: a soft gate on the token ratio instead of a clip; clip_low / clip_high only set its band metric."""

    name = "sapo"
    default_clip = SAPO_BAND
    Options = SAPOOptions
    fn = staticmethod(sapo_loss)


@register_policy_loss
class CISPO(PolicyLoss):
    """CISPO: REINFORCE with a clipped, detached importance weight; no lower bound by default."""

    name = "cispo"
    default_clip = CISPO_CLIP
    default_agg_mode = "token-mean"
    open_low = True
    fn = staticmethod(cispo_loss)
