"""GMPO (arXiv:2507.20673) and RSPO (arXiv:2510.23027) policy losses: the geometric mean of token ratios.

GMPO maximizes, per response i with one advantage A_i,

    J_i = ( prod_t | min(w_{i,t} A_i, clip(w_{i,t}, e^-eps_low, e^eps_high) A_i) | )^(1/|y_i|) * sgn(A_i)

with clipping per token, in log space, before the geometric mean. Since |min(w A, clip(w) A)| = |A| * min(w, clip(w))
for A > 0 and |A| * max(w, clip(w)) for A < 0, this is J_i = A_i * exp(mean_t l~_{i,t}) with the clipped log-ratio

    l~_{i,t} = sgn(A_i) * min(sgn(A_i) * l_{i,t}, sgn(A_i) * clip(l_{i,t}, -eps_low, eps_high)),  l = logp - old_logp,

which is how it is computed (a sum of logs, no products). A token on the clipped side of its bound adds a constant
to the mean and gets no gradient; every other token gets d J_i / d logp_{i,t} = A_i exp(mean l~) / |y_i|.

RSPO is the same objective on router-shift-rescaled ratios gamma_{i,t} * w_{i,t} (registry.py applies the weight,
router_shift.py computes it); registered as `rspo`, it refuses to run without the weight.

Aggregation: one term per response. `seq-mean-token-mean` is the papers' 1/G sum_i J_i; `token-mean` weighs J_i by
|y_i| / (tokens in the batch). `seq-mean-token-sum` would multiply each length-normalized J_i by |y_i| without
dividing by the token count, making the loss scale with response length, and is refused.

Metrics: pg_loss, pg_clipfrac (fraction of response tokens on the clipped side of their bound), pg_clipfrac_lower
(0: no dual-clip), ppo_kl, seq_clipfrac (fraction of non-empty responses with a clipped token), ratio_mean/min/max
(the sequence ratios exp(mean l~) over non-empty responses, after clipping).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import agg_seq_loss
from moe_gspo.losses.policy import _frac, surrogate_metrics
from moe_gspo.losses.registry import PolicyLoss, register_policy_loss

GMPO_CLIP = (0.4, 0.4)  # arXiv:2507.20673: log-ratios clipped to [-0.4, 0.4], i.e. ratios to [e^-0.4, e^0.4]
GMPO_AGG_MODES = ("seq-mean-token-mean", "token-mean")


def gmpo_loss(
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
    """Geometric-mean objective with per-token log-space clipping; advantages [B] (one per sequence).

    clip_low / clip_high bound the log-ratio: [-clip_low, clip_high]. Returns (-aggregated J, metrics).
    """
    if advantages.dim() != 1:
        raise ValueError(f"gmpo/rspo need one advantage per sequence, advantages [B]; got shape "
                         f"{tuple(advantages.shape)}")
    lengths_B = mask.sum(-1)
    nonempty_B = lengths_B > 0
    sign = torch.sign(advantages)[:, None]  # (B, 1); 0 for A = 0, whose term is 0 anyway
    log_ratio = (logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp)  # (B, T)
    bounded = log_ratio.clamp(-clip_low, clip_high)
    tok = sign * torch.minimum(sign * log_ratio, sign * bounded)  # (B, T) clipped log-ratio l~
    clipped = (sign * log_ratio > sign * bounded) & mask
    seq_log_ratio = torch.where(mask, tok, 0).sum(-1) / lengths_B.clamp(min=1).to(tok.dtype)  # (B,)
    seq_ratio = torch.exp(seq_log_ratio)
    pg_loss = agg_seq_loss(-advantages * seq_ratio, lengths_B, loss_agg_mode, loss_denominator)
    return pg_loss, surrogate_metrics(pg_loss, logp, old_logp, mask, seq_ratio, nonempty_B, _frac(clipped, mask),
                                      seq_clipfrac=_frac(clipped.any(-1), nonempty_B))


@register_policy_loss
class GMPO(PolicyLoss):
    """GMPO: the geometric mean of per-token clipped ratios (log-space clip)."""

    name = "gmpo"
    default_clip = GMPO_CLIP
    clip_space = "log"
    agg_modes = GMPO_AGG_MODES
    fn = staticmethod(gmpo_loss)


@register_policy_loss
class RSPO(GMPO):
    """RSPO (arXiv:2510.23027): GMPO on router-shift-rescaled ratios; the paper builds on GMPO, so its clip range
    is GMPO's."""

    name = "rspo"
    needs_router_shift = True
