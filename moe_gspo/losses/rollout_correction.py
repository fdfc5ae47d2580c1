"""Rollout-mismatch correction: importance weights and rejection by the engine-vs-trainer ratio.

The rollout engine samples with its own kernels and precision (and, for an MoE, sometimes other experts), so the
policy that produced a response, pi_engine, is not the trainer's pi_old. Per response token

    rho_{i,t} = pi_trainer(y_t) / pi_engine(y_t),      log_ratio_BT = trainer_logp - engine_logp

and the two tools below follow verl's rollout correction (its trainer's rollout_corr_helper and its algorithm guide
"rollout_corr"):

    w, m = rollout_is_weights(log_ratio_BT, mask_BT, level="token", threshold=2.0)           # TIS
    w, m = rollout_is_weights(log_ratio_BT, mask_BT, level="sequence", threshold=(0.5, 2.0)) # IcePop band
    keep, m = rollout_rejection_mask(log_ratio_BT, mask_BT, mode="seq_mean_k1", threshold=(0.999, 1.001))

Importance weights (detached, 0 off the mask; log-ratios clamped to +-20 before exp, as in the losses):
    token     w_{i,t} = rho_{i,t}
    sequence  w_{i,t} = exp(sum_t log rho_{i,t})                 the same for every token of response i
    threshold C (a number > 0):          w <- min(w, C)            truncated IS (TIS)
    threshold (lower, upper):            w <- w if lower <= w <= upper else 0     (IcePop)

Rejection (a keep mask, False off the mask), with l = clamp(log rho, -20, 20) per token and verl's statistics
    k1 = -l     k2 = l^2 / 2     k3 = exp(l) - 1 - l
    token_kX     per token                          seq_sum_kX   sum over the response's tokens
    seq_mean_kX  mean over the response's tokens    seq_max_kX   max over the response's tokens (k2, k3 only)
k2 and k3 take one upper bound U and keep a token (a whole response for seq_*) when the statistic is <= U. k1 takes
ratio bounds (lower, upper) (a single number u means (1/u, u)) and keeps log(lower) <= statistic <= log(upper);
seq_mean_k1 is thus a band on the geometric mean of 1/rho ("Geo-RS"), symmetric for symmetric bounds.

The trainer applies both to any registered loss through one RolloutCorrection object built from the config
(`rollout_correction_from_config`, checked at load): the weight scales each token's gradient (registry.py), the
rejected tokens leave the loss's mask.

    corr = rollout_correction_from_config(cfg.algorithm, loss)   # ValueError "<field>=<value>: why" when bad
    pi_old = corr.pi_old(old_logp_BT, engine_logp_BT)             # the engine's in bypass mode
    out = corr(trainer_logp_BT, engine_logp_BT, mask_BT)          # Correction(mask, weight or None, metrics)
 Metrics (0-dim detached tensors over this call's response tokens):
    rollout_corr/is_mean, is_max, is_min       the applied weights
    rollout_corr/is_ess                        effective sample size (sum w)^2 / (n sum w^2), in [0, 1]
    rollout_corr/is_truncated_frac             tokens whose weight TIS lowered to C
    rollout_corr/is_masked_frac, is_seq_masked_frac   tokens (responses with a token) IcePop set to 0
    rollout_corr/rs_masked_frac, rs_seq_masked_frac   tokens (responses with a token) rejected
    rollout_corr/rs_stat_mean, rs_stat_max     the rejection statistic (per token, or per response for seq_*)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_gspo.losses.registry import LOG_RATIO_CLAMP

IS_LEVELS = ("token", "sequence")
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
PREFIX = "rollout_corr/"


def is_threshold_bounds(threshold) -> tuple[float | None, float]:
    """(lower or None, upper) of an IS threshold: C > 0 (TIS) or a pair 0 < lower <= upper (IcePop)."""
    if isinstance(threshold, (list, tuple)):
        if len(threshold) != 2:
            raise ValueError(f"rollout_is_threshold={threshold!r}: give one number C or a pair (lower, upper)")
        lower, upper = float(threshold[0]), float(threshold[1])
        if not (0 < lower <= upper < math.inf):
            raise ValueError(f"rollout_is_threshold={list(threshold)!r}: need 0 < lower <= upper (finite)")
        return lower, upper
    c = float(threshold)
    if not 0 < c < math.inf:
        raise ValueError(f"rollout_is_threshold={threshold!r} must be a finite number > 0")
    return None, c


def rs_threshold_bounds(mode: str, threshold) -> tuple[float | None, float]:
    """(lower or None, upper) of a rejection threshold; k1 modes always get a lower bound (1/u for one number u)."""
    if mode not in RS_MODES:
        raise ValueError(f"unknown rollout_rs mode {mode!r}; valid modes: {', '.join(RS_MODES)}")
    if threshold is None:
        raise ValueError(f"rollout_rs_threshold is required with rollout_rs={mode!r}")
    pair = isinstance(threshold, (list, tuple))
    if pair and not mode.endswith("k1"):
        raise ValueError(f"rollout_rs_threshold={list(threshold)!r}: {mode} takes one upper bound, not a pair")
    if pair:
        if len(threshold) != 2:
            raise ValueError(f"rollout_rs_threshold={threshold!r}: give one number or a pair (lower, upper)")
        lower, upper = float(threshold[0]), float(threshold[1])
    else:
        upper = float(threshold)
        lower = 1.0 / upper if mode.endswith("k1") and upper > 0 else None
    if not 0 < upper < math.inf or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_rs_threshold={threshold!r} for {mode}: need finite bounds with "
                         f"{'0 < lower <= upper' if mode.endswith('k1') else 'upper > 0'}")
    return lower, upper


def rollout_log_ratio(trainer_logp_BT: Tensor, engine_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log rho = trainer_logp - engine_logp on the mask, 0 elsewhere (garbage off the mask never enters), detached,
    in float32 or wider."""
    dtype = torch.promote_types(trainer_logp_BT.dtype, torch.float32)
    d = trainer_logp_BT.detach().to(dtype) - engine_logp_BT.detach().to(dtype)
    return torch.where(mask_BT.bool(), d, torch.zeros((), dtype=dtype, device=d.device))


def _masked(log_ratio_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    mask = mask_BT.bool()
    lr = log_ratio_BT.detach()
    lr = torch.where(mask, lr.to(torch.promote_types(lr.dtype, torch.float32)), 0.0)
    return lr, mask


def _frac(flag: Tensor, valid: Tensor) -> Tensor:
    return ((flag & valid).sum() / valid.sum().clamp(min=1)).float()


def rollout_is_weights(log_ratio_BT: Tensor, mask_BT: Tensor, level: str = "token",
                       threshold: float | tuple[float, float] = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """(weights (B, T) detached, 0 off the mask; metrics) of truncated IS (threshold C) or IcePop (lower, upper).

    log_ratio_BT: log pi_trainer - log pi_engine (B, T); mask_BT: response tokens (B, T) bool; level: 'token' or
    'sequence' (w = exp of the response's summed log-ratio, broadcast over its tokens)."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    lower, upper = is_threshold_bounds(threshold)
    lr, mask = _masked(log_ratio_BT, mask_BT)
    if level == "token":
        raw = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        raw = torch.exp(lr.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(lr)
    if lower is None:
        w = raw.clamp(max=upper)
        zeroed = torch.zeros_like(mask)
    else:
        zeroed = (raw < lower) | (raw > upper)
        w = torch.where(zeroed, 0.0, raw)
    w = torch.where(mask, w, 0.0)
    zeroed &= mask
    n = mask.sum()
    s1, s2 = w.sum(), (w * w).sum()
    any_tok = n > 0
    one = w.new_ones(())
    nonempty = mask.any(-1)
    metrics = {
        "is_mean": torch.where(any_tok, s1 / n.clamp(min=1), one),
        "is_max": torch.where(any_tok, torch.where(mask, w, -math.inf).amax(), one),
        "is_min": torch.where(any_tok, torch.where(mask, w, math.inf).amin(), one),
        # 1 / mean((w / mean w)^2) over the tokens; 0 when every weight is 0
        "is_ess": torch.where(s2 > 0, s1 * s1 / (n.clamp(min=1) * s2.clamp(min=torch.finfo(w.dtype).tiny)), 0.0),
        "is_truncated_frac": _frac((raw > upper) if lower is None else torch.zeros_like(mask), mask),
        "is_masked_frac": _frac(zeroed, mask),
        "is_seq_masked_frac": _frac(zeroed.any(-1), nonempty),
    }
    return w.detach(), {PREFIX + k: v.detach().float() for k, v in metrics.items()}


def rollout_rejection_mask(log_ratio_BT: Tensor, mask_BT: Tensor, mode: str,
                           threshold: float | tuple[float, float]) -> tuple[Tensor, dict[str, Tensor]]:
    """(keep (B, T) bool, False off the mask; metrics): verl's rejection modes (module docstring)."""
    lower, upper = rs_threshold_bounds(mode, threshold)
    lr, mask = _masked(log_ratio_BT, mask_BT)
    lr = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    est = mode.rsplit("_", 1)[1]
    stat = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.expm1(lr) - lr}[est]
    stat = torch.where(mask, stat, 0.0)
    nonempty = mask.any(-1)
    if mode.startswith("token_"):
        valid, per = mask, stat
    else:
        valid = nonempty
        if mode.startswith("seq_sum_"):
            per = stat.sum(-1)
        elif mode.startswith("seq_mean_"):
            per = stat.sum(-1) / mask.sum(-1).clamp(min=1)
        else:  # seq_max_: 0 for an empty response
            per = torch.where(nonempty, torch.where(mask, stat, -math.inf).amax(-1), 0.0)
    if est == "k1":
        ok = (per >= math.log(lower)) & (per <= math.log(upper))
    else:
        ok = per <= upper
    keep = (ok if mode.startswith("token_") else ok[:, None]) & mask
    rejected = mask & ~keep
    zero = per.new_zeros(())
    metrics = {
        "rs_masked_frac": _frac(rejected, mask),
        "rs_seq_masked_frac": _frac(rejected.any(-1), nonempty),
        "rs_stat_mean": torch.where(valid, per, 0.0).sum() / valid.sum().clamp(min=1),
        "rs_stat_max": torch.where(valid.any(), torch.where(valid, per, -math.inf).amax(), zero),
    }
    return keep, {PREFIX + k: v.detach().float() for k, v in metrics.items()}


@dataclass(frozen=True)
class Correction:
    """What the rollout correction does to some rows: their loss mask without the rejected tokens, the per-token
    importance weight (None without IS) and the metrics (0-dim detached tensors)."""

    mask: Tensor  # (b, T) bool
    weight: Tensor | None  # (b, T) detached, or None
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class RolloutCorrection:
    """The rollout correction a run applies, built once from the config, and where pi_old comes from.

    decoupled (bypass=False): pi_old is the training engine's old-log-prob pass; rho = pi_old / pi_engine is
        known before the updates, so the trainer computes it once per minibatch and the rejected tokens also leave
        the minibatch's denominator.
    bypass (bypass=True, algorithm.use_engine_logprobs): pi_old is the engine's log-probs, so the loss's own
        ratio pi_theta / pi_engine carries the engine correction; rho = pi_theta / pi_engine with pi_theta the
        detached current log-probs, computed in every loss call (`per_loss_call`); rejection only (IS would
        count the correction twice).
    """

    is_level: str = "off"  # "off" or an IS_LEVELS entry
    is_threshold: float | tuple[float, float] = 2.0
    rs_mode: str = "off"  # "off" or an RS_MODES entry
    rs_threshold: float | tuple[float, float] | None = None
    bypass: bool = False

    @property
    def active(self) -> bool:
        """Whether any token is weighted or rejected."""
        return self.is_level != "off" or self.rs_mode != "off"

    @property
    def per_minibatch(self) -> bool:
        """rho from pi_old, computed once per minibatch before the updates (decoupled mode)."""
        return self.active and not self.bypass

    @property
    def per_loss_call(self) -> bool:
        """rho from the current log-probs, computed in every loss call (bypass mode with rejection)."""
        return self.active and self.bypass

    def pi_old(self, old_logp_BT: Tensor, engine_logp_BT: Tensor) -> Tensor:
        """The log-probs the loss takes as pi_old: the engine's in bypass mode, the old-log-prob pass's else."""
        return engine_logp_BT if self.bypass else old_logp_BT

    def __call__(self, trainer_logp_bT: Tensor, engine_logp_bT: Tensor, mask_bT: Tensor) -> Correction:
        """Rejection, then importance weights over the tokens that stay, of rows whose trainer-side log-probs are
        trainer_logp_bT (detached here) and engine log-probs engine_logp_bT; mask_bT: their response tokens."""
        log_ratio = rollout_log_ratio(trainer_logp_bT, engine_logp_bT, mask_bT)
        metrics, weight, mask = {}, None, mask_bT
        if self.rs_mode != "off":
            mask, m = rollout_rejection_mask(log_ratio, mask, self.rs_mode, self.rs_threshold)
            metrics.update(m)
        if self.is_level != "off":
            weight, m = rollout_is_weights(log_ratio, mask, self.is_level, self.is_threshold)
            metrics.update(m)
        return Correction(mask, weight, metrics)


def rollout_correction_from_config(a, loss=None) -> RolloutCorrection:
    """The correction an AlgorithmConfig asks for (rollout_is, rollout_rs and their thresholds;
    use_engine_logprobs for bypass), with `loss` (the run's PolicyLoss) to check bypass against its ratio level.

    Raises ValueError "<field>=<value>: why" naming the algorithm field at fault."""
    if a.rollout_is not in ("off",) + IS_LEVELS:
        raise ValueError(f"rollout_is={a.rollout_is!r} is not one of {['off', *IS_LEVELS]}")
    if a.rollout_rs not in ("off",) + RS_MODES:
        raise ValueError(f"rollout_rs={a.rollout_rs!r} is not one of {['off', *RS_MODES]}")
    is_threshold_bounds(a.rollout_is_threshold)
    if a.rollout_rs != "off":
        rs_threshold_bounds(a.rollout_rs, a.rollout_rs_threshold)
    elif a.rollout_rs_threshold is not None:  # unused, but checked like any value
        try:
            is_threshold_bounds(a.rollout_rs_threshold)
        except ValueError:
            raise ValueError(f"rollout_rs_threshold={a.rollout_rs_threshold!r}: give a finite number > 0 or a pair "
                             "[lower, upper] with 0 < lower <= upper") from None
    if a.use_engine_logprobs and a.rollout_is != "off":
        raise ValueError(f"rollout_is={a.rollout_is!r} cannot go with algorithm.use_engine_logprobs=true: the "
                         "loss's ratio pi_theta / pi_engine already corrects for the engine (bypass mode takes "
                         "algorithm.rollout_rs only)")
    if a.use_engine_logprobs and loss is not None and loss.ratio_level == "token" and not a.bypass_token_ratios:
        raise ValueError(f"use_engine_logprobs=True with algorithm.loss={loss.name!r}: its ratio is per token, so "
                         "every token's ratio carries the engine-vs-trainer numeric mismatch (a sequence ratio, as "
                         "gspo's, averages it over the response); use a sequence-ratio loss, recompute pi_old "
                         "(use_engine_logprobs=false), or accept it with algorithm.bypass_token_ratios=true")

    def pair(t):
        return tuple(float(x) for x in t) if isinstance(t, (list, tuple)) else t

    return RolloutCorrection(a.rollout_is, pair(a.rollout_is_threshold), a.rollout_rs, pair(a.rollout_rs_threshold),
                             bool(a.use_engine_logprobs))
