"""GRPO, GSPO and GSPO-token policy losses (arXiv:2402.03300, arXiv:2507.18071).

Each loss is a small pure function, registered by name as the `fn` of a PolicyLoss class (registry.py, whose
call validates inputs, handles the packed layout and the optional KL term before calling it):

    loss, metrics = build_policy_loss("gspo", clip_low=3e-4)(logp, old_logp, advantages, mask)

Shapes after the registry's handling: logp, old_logp, mask [B, T] (mask bool, True on response tokens;
logp and old_logp are 0 off the mask and old_logp is detached); advantages [B] or [B, T].
`loss` is the scalar to minimize (minus the clipped surrogate objective). The ratio is
exp(clamp(log-ratio, -log_ratio_clamp, log_ratio_clamp)); the default clamp 20 keeps exp finite in
float32 and is far outside any clip range (an in-range ratio is never changed by it).

Metrics (0-dim detached tensors, computed over this call's tokens):
    pg_loss            the policy-gradient term of the loss (without KL)
    pg_clipfrac        fraction of response tokens whose term takes the clipped branch (zero gradient);
                       for gspo: the fraction of tokens carried by clipped sequences
    pg_clipfrac_lower  fraction of response tokens held by GRPO's dual-clip bound (0 without dual-clip)
    ppo_kl             token mean of old_logp - logp (k1 estimate of KL(pi_old || pi_theta))
    ratio_mean/min/max token ratios w_{i,t} (grpo) or sequence ratios s_i (gspo, gspo_token)
    seq_clipfrac       (gspo, gspo_token) fraction of non-empty sequences with a clipped term
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import agg_loss, agg_seq_loss
from moe_gspo.losses.registry import LossConfigError, PolicyLoss, ppo_kl, register_policy_loss


def _frac(flag: Tensor, valid: Tensor) -> Tensor:
    """Fraction of `valid` entries where `flag` holds (0 when none is valid), detached."""
    return ((flag & valid).sum() / valid.sum().clamp(min=1)).detach()  # default float dtype


def _stats(values: Tensor, valid: Tensor, prefix: str) -> dict[str, Tensor]:
    """Mean/min/max of values over valid entries (1.0 when none is valid), detached."""
    values = values.detach()
    any_valid = valid.any()
    one = values.new_ones(())
    mean = torch.where(valid, values, 0).sum() / valid.sum().clamp(min=1)
    vmin = torch.where(valid, values, torch.inf).amin()
    vmax = torch.where(valid, values, -torch.inf).amax()
    return {
        f"{prefix}_mean": torch.where(any_valid, mean, one),
        f"{prefix}_min": torch.where(any_valid, vmin, one),
        f"{prefix}_max": torch.where(any_valid, vmax, one),
    }


def surrogate_metrics(pg_loss: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor, ratio: Tensor, ratio_valid: Tensor,
                      clipfrac: Tensor, clipfrac_lower: Tensor | None = None, **extra: Tensor) -> dict[str, Tensor]:
    """The metrics every policy loss reports (see the module docstring), then the loss's own `extra` ones; the
    ratio statistics are over `ratio_valid` (tokens for token ratios, non-empty rows for sequence ratios)."""
    lower = torch.zeros((), device=mask.device) if clipfrac_lower is None else clipfrac_lower
    return {"pg_loss": pg_loss.detach(), "pg_clipfrac": clipfrac, "pg_clipfrac_lower": lower,
            "ppo_kl": ppo_kl(logp, old_logp, mask), **extra, **_stats(ratio, ratio_valid, "ratio")}


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, length_normalize: bool = True) -> Tensor:
    """GSPO's length-normalized log-ratio: 1/|y_i| sum_t mask (logp - old_logp) -> [B] (0 for an empty row); with
    length_normalize=False the plain sum (the log of the whole response's likelihood ratio)."""
    diff = torch.where(mask, logp - old_logp, torch.zeros_like(logp)).sum(-1)
    return diff / mask.sum(-1).clamp(min=1).to(logp.dtype) if length_normalize else diff


def grpo_loss(
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
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / PPO token-level clipped surrogate; optional dual-clip bound clip_ratio_c (> 1) for A < 0.

    w_{i,t} = exp(logp - old_logp); l_{i,t} = max(-A w, -A clip(w, 1 - clip_low, 1 + clip_high)),
    and with dual-clip, for A < 0: l_{i,t} = min(l_{i,t}, -A clip_ratio_c). advantages: [B] or [B, T].
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) or (B, 1)
    log_ratio = (logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp)  # (B, T)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(mask)
    if clip_ratio_c is not None:
        pg3 = -adv * clip_ratio_c
        dual = (adv < 0) & (pg_losses > pg3)
        pg_losses = torch.where(dual, pg3.expand_as(pg_losses), pg_losses)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, loss_denominator)
    return pg_loss, surrogate_metrics(pg_loss, logp, old_logp, mask, ratio, mask, _frac(clipped, mask),
                                      _frac(dual, mask))


def gspo_loss(
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
    length_normalize: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO sequence-level clipped surrogate; advantages [B] (one per sequence).

    s_i = exp(clamp(1/|y_i| sum_t (logp - old_logp))); J_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)).
    Aggregated per sequence (agg_seq_loss): the default seq-mean-token-mean is the paper's 1/G sum_i J_i.
    length_normalize=False drops the 1/|y_i| (s_i the whole response's likelihood ratio), which the paper calls
    essential: an ablation switch, not a recommended setting.
    """
    if advantages.dim() != 1:
        raise ValueError(
            f"gspo needs one advantage per sequence, advantages [B]; got shape {tuple(advantages.shape)} "
            "(use gspo_token for per-token advantages)"
        )
    lengths_B = mask.sum(-1)
    nonempty_B = lengths_B > 0
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask, length_normalize)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))  # (B,)
    pg1 = -advantages * seq_ratio
    pg2 = -advantages * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    seq_losses = torch.maximum(pg1, pg2)  # (B,)
    clipped_B = (pg2 > pg1) & nonempty_B
    pg_loss = agg_seq_loss(seq_losses, lengths_B, loss_agg_mode, loss_denominator)
    return pg_loss, surrogate_metrics(pg_loss, logp, old_logp, mask, seq_ratio, nonempty_B,
                                      _frac(clipped_B[:, None].expand_as(mask), mask),
                                      seq_clipfrac=_frac(clipped_B, nonempty_B))


def gspo_token_loss(
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
    """GSPO-token: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], per-token advantages [B, T] (or [B], broadcast).

    Value of s_{i,t} is s_i; its gradient is s_i * grad logp_{i,t}. With A_{i,t} = A_i this equals gspo in value,
    clipping and gradient (clamping aside: the clamp acts on the detached s_i here).
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    lengths_B = mask.sum(-1)
    nonempty_B = lengths_B > 0
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask).clamp(-log_ratio_clamp, log_ratio_clamp).detach()
    tok_ratio = torch.exp(seq_log_ratio[:, None] + logp - logp.detach())  # (B, T), value s_i
    pg1 = -adv * tok_ratio
    pg2 = -adv * tok_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1) & mask
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, loss_denominator)
    return pg_loss, surrogate_metrics(pg_loss, logp, old_logp, mask, torch.exp(seq_log_ratio), nonempty_B,
                                      _frac(clipped, mask), seq_clipfrac=_frac(clipped.any(-1), nonempty_B))


@dataclass(frozen=True)
class GRPOOptions:
    clip_ratio_c: float | None = None
    """Dual-clip bound (> 1) on the loss of tokens with negative advantage; None: no dual clip."""

    def __post_init__(self):
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise LossConfigError("loss_options.clip_ratio_c", self.clip_ratio_c, "the dual-clip bound must be > 1")


@register_policy_loss
class GRPO(PolicyLoss):
    """GRPO / PPO's token-level clipped surrogate (arXiv:2402.03300)."""

    name = "grpo"
    default_clip = (0.2, 0.27)
    Options = GRPOOptions
    fn = staticmethod(grpo_loss)


@dataclass(frozen=True)
class GSPOOptions:
    length_normalize: bool = True
    """Normalize the sequence log-ratio by the response length |y_i| (the paper's s_i). False (an ablation) uses
    the whole response's likelihood ratio, whose spread grows with length."""

    def __post_init__(self):
        if not isinstance(self.length_normalize, bool):
            raise LossConfigError("loss_options.length_normalize", self.length_normalize, "must be true or false")


@register_policy_loss
class GSPO(PolicyLoss):
    """GSPO's sequence-level clipped surrogate (arXiv:2507.18071)."""

    name = "gspo"
    default_clip = (3e-4, 4e-4)
    ratio_level = "sequence"
    Options = GSPOOptions
    fn = staticmethod(gspo_loss)


@register_policy_loss
class GSPOToken(PolicyLoss):
    """GSPO-token: GSPO's sequence ratio with per-token advantages."""

    name = "gspo_token"
    default_clip = (3e-4, 4e-4)
    ratio_level = "sequence"
    fn = staticmethod(gspo_token_loss)
