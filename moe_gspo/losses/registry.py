"""Registry of policy losses and the input handling shared by all of them.

`register_policy_loss(name, default_clip=...)` wraps a pure loss function so that every registered loss:
  - takes clip_low / clip_high = None to mean the paper's default (DEFAULT_CLIP[name]); a loss registered with
    clip_space="log" (gmpo, rspo) reads them as bounds on the log-ratio, [-clip_low, clip_high],
  - accepts the padded [B, T] layout or the packed layout (cu_seqlens=[B + 1], tensors [total] or [1, total]),
  - checks shapes, and checks that logp, old_logp, ref_logp and advantages are finite at response positions
    (one host sync per call; check_finite=False skips it), raising ValueError naming the tensor,
  - ignores everything off the mask (padding may hold garbage, even NaN),
  - adds the optional k3 KL to a reference policy, beta * agg(exp(ref - logp) - (ref - logp) - 1),
  - applies an optional per-token router-shift weight gamma [B, T] (RSPO, arXiv:2510.23027; required by losses
    registered with needs_router_shift): the importance ratio w = exp(logp - old_logp) becomes gamma * w before the
    loss clips and aggregates it. That is the same as lowering old_logp by log gamma, which is how it is applied,
    so every registered loss takes the weight without code of its own; `ppo_kl` is still measured against the
    true old_logp, while the ratio stats describe the rescaled ratios the loss clips.
  - applies an optional per-token rollout-correction weight w [B, T] (rollout_correction.py): a detached
    multiplier of each token's gradient. The loss sees logp' = sg[logp] + w (logp - sg[logp]), equal to logp in
    value (so clipping, ratios and metrics are unchanged) with d logp' / d logp = w, so d loss / d logp_{i,t} is
    multiplied by exactly w_{i,t} for every registered loss, sequence-level ones included. The KL term is not
    weighted.
`get_policy_loss(name)` returns the wrapped function; an unknown name raises ValueError listing valid names.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import AGG_MODES, agg_loss, check_agg_mode
from moe_gspo.losses.packed import check_cu_seqlens, pad_packed

LOG_RATIO_CLAMP = 20.0  # |log-ratio| is clamped to this before exp (exp(20) ~ 4.9e8, finite in fp16/bf16/fp32)
DEFAULT_AGG_MODE = "seq-mean-token-mean"  # the paper's 1/G sum_i 1/|y_i| sum_t, for all three losses

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
DEFAULT_CLIP: dict[str, tuple[float, float]] = {}
DEFAULT_AGG: dict[str, str] = {}  # loss_agg_mode=None takes this (seq-mean-token-mean but for cispo)
ROUTER_SHIFT_LOSSES: set[str] = set()  # losses that cannot run without a router-shift weight (rspo)


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss registered as `name` (grpo, gspo, gspo_token, gmpo, rspo, sapo, cispo); unknown names raise
    ValueError listing the valid ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def ppo_kl(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """Token mean of old_logp - logp over the mask (k1 estimate of KL(pi_old || pi_theta)), detached."""
    return (torch.where(mask, old_logp - logp, 0).sum() / mask.sum().clamp(min=1)).detach()


def kl_k3(logp: Tensor, ref_logp: Tensor, log_ratio_clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(d) - d - 1 with d = clamp(ref_logp - logp)."""
    d = (ref_logp - logp).clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS = ("k1", "k3", "low_var_kl")


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3",
               log_ratio_clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta, d = logp - ref_logp:
    'k1' = d; 'k3' = exp(-d) + d - 1 (unbiased, >= 0; log ratio clamped to +-log_ratio_clamp);
    'low_var_kl' = k3 clamped to [-10, 10] (verl's name for it)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        return kl_k3(logp, ref_logp, log_ratio_clamp)
    if estimator == "low_var_kl":
        return kl_k3(logp, ref_logp, log_ratio_clamp).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)}")


def _check_finite(tensors: dict[str, Tensor], mask_BT: Tensor) -> None:
    """Raise ValueError naming every tensor with NaN/inf at a response position; one host sync in all."""
    rows_B = mask_BT.any(-1)
    bad = []
    for x in tensors.values():
        valid = mask_BT if x.dim() == 2 else rows_B
        bad.append((~torch.isfinite(x) & valid).any())
    flags = torch.stack(bad).tolist()
    names = [n for n, f in zip(tensors, flags) if f]
    if names:
        why = " (router_shift_weight must be finite and > 0)" if "router_shift_weight" in names else ""
        raise ValueError(f"policy loss inputs contain NaN or inf at response (mask=True) positions: "
                         f"{', '.join(names)}{why}")


def _check_shapes(name: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp,
                  router_shift_weight, rollout_is_weight=None) -> None:
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be [B, T] (or packed with cu_seqlens), got shape {tuple(logp.shape)}")
    for tname, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp),
                     ("router_shift_weight", router_shift_weight), ("rollout_is_weight", rollout_is_weight)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name}: {tname} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"{name}: advantages must be [B] = {list(logp.shape[:1])} or [B, T] = {list(logp.shape)}, "
            f"got {list(advantages.shape)}"
        )


def _to_padded(cu_seqlens: Tensor, max_seqlen, logp, old_logp, advantages, mask, ref_logp, router_shift_weight,
               rollout_is_weight):
    """Packed -> padded for every per-token tensor; per-sequence advantages [B] pass through.

    A 1-D advantages tensor of length B is per-sequence, even when logp is [total] with total == B;
    per-token advantages then have to come as [1, total].
    """
    flat = logp[0] if logp.dim() == 2 else logp
    num_seqs = len(check_cu_seqlens(cu_seqlens, total=flat.shape[0]))

    def pad(x, n):
        if x is None:
            return None
        if tuple(x.shape) not in ((flat.shape[0],), (1, flat.shape[0])):
            raise ValueError(f"packed {n} must be [total] or [1, total], total = {flat.shape[0]}; got {tuple(x.shape)}")
        return pad_packed(x, cu_seqlens, max_seqlen, name=n)

    per_seq = advantages.shape == (num_seqs,)
    adv = advantages if per_seq else pad(advantages, "advantages")
    return (pad(logp, "logp"), pad(old_logp, "old_logp"), adv, pad(mask, "mask"), pad(ref_logp, "ref_logp"),
            pad(router_shift_weight, "router_shift_weight"), pad(rollout_is_weight, "rollout_is_weight"))


def register_policy_loss(name: str, *, default_clip: tuple[float, float], clip_space: str = "ratio",
                         agg_modes: tuple[str, ...] = AGG_MODES, needs_router_shift: bool = False,
                         default_agg_mode: str = DEFAULT_AGG_MODE, open_low: bool = False):
    """Decorator: wrap a pure loss `fn` with the shared input handling and register it as `name`.

    clip_space: "ratio" (clip w to [1 - clip_low, 1 + clip_high], clip_low < 1, or <= 1 with open_low, where 1 means
    no lower bound) or "log" (clip log w to [-clip_low, clip_high]). agg_modes: the loss_agg_mode values the loss
    accepts; default_agg_mode: the one loss_agg_mode=None picks. needs_router_shift: calls without
    router_shift_weight raise."""
    if clip_space not in ("ratio", "log"):
        raise ValueError(f"clip_space must be 'ratio' or 'log', got {clip_space!r}")

    def deco(fn):
        @functools.wraps(fn)
        def wrapped(
            logp: Tensor,
            old_logp: Tensor,
            advantages: Tensor,
            mask: Tensor,
            *,
            clip_low: float | None = None,
            clip_high: float | None = None,
            loss_agg_mode: str | None = None,
            loss_denominator: Tensor | float | None = None,
            ref_logp: Tensor | None = None,
            beta: float = 0.0,
            kl_estimator: str = "k3",
            log_ratio_clamp: float = LOG_RATIO_CLAMP,
            router_shift_weight: Tensor | None = None,
            rollout_is_weight: Tensor | None = None,
            cu_seqlens: Tensor | None = None,
            max_seqlen: int | None = None,
            check_finite: bool = True,
            **options,
        ) -> tuple[Tensor, dict[str, Tensor]]:
            clip_low = default_clip[0] if clip_low is None else float(clip_low)
            clip_high = default_clip[1] if clip_high is None else float(clip_high)
            low_ok = clip_low <= 1.0 if open_low else clip_low < 1.0
            if clip_space == "ratio" and not (0.0 <= clip_low and low_ok and clip_high >= 0.0):
                raise ValueError(f"{name}: need 0 <= clip_low {'<=' if open_low else '<'} 1 and clip_high >= 0, "
                                 f"got ({clip_low}, {clip_high})")
            loss_agg_mode = default_agg_mode if loss_agg_mode is None else loss_agg_mode
            if clip_space == "log" and not (0.0 <= clip_low < float("inf") and 0.0 <= clip_high < float("inf")):
                raise ValueError(f"{name}: clip_low and clip_high bound the log-ratio and must be finite and >= 0, "
                                 f"got ({clip_low}, {clip_high})")
            check_agg_mode(loss_agg_mode)
            if loss_agg_mode not in agg_modes:
                raise ValueError(f"{name}: loss_agg_mode={loss_agg_mode!r} is not supported by this loss "
                                 f"(algorithm.loss_agg_mode); use one of {', '.join(agg_modes)}")
            if beta != 0.0 and ref_logp is None:
                raise ValueError(f"{name}: beta={beta} needs ref_logp (reference policy log-probs)")
            if needs_router_shift and router_shift_weight is None:
                raise ValueError(f"{name}: needs router_shift_weight [B, T], the per-token router-shift weight from "
                                 "the old and current router scores (moe_gspo.losses.router_shift_weight)")
            if cu_seqlens is not None:
                logp, old_logp, advantages, mask, ref_logp, router_shift_weight, rollout_is_weight = _to_padded(
                    cu_seqlens, max_seqlen, logp, old_logp, advantages, mask, ref_logp, router_shift_weight,
                    rollout_is_weight)
            _check_shapes(name, logp, old_logp, advantages, mask, ref_logp, router_shift_weight, rollout_is_weight)
            mask = mask.bool()
            dtype = torch.promote_types(logp.dtype, torch.float32)
            zero = logp.new_zeros((), dtype=dtype)
            log_weight = None
            if router_shift_weight is not None:
                log_weight = torch.log(router_shift_weight.detach().to(dtype))  # stop-gradient weight
            inputs = {"logp": logp, "old_logp": old_logp, "advantages": advantages}
            if ref_logp is not None:
                inputs["ref_logp"] = ref_logp
            if log_weight is not None:
                inputs["router_shift_weight"] = log_weight  # log: a weight <= 0 shows up as -inf / NaN
            if rollout_is_weight is not None:
                rollout_is_weight = rollout_is_weight.detach().to(dtype)
                inputs["rollout_is_weight"] = rollout_is_weight
            if check_finite:
                _check_finite(inputs, mask)
            logp = torch.where(mask, logp.to(dtype), zero)
            old_logp = torch.where(mask, old_logp.detach().to(dtype), zero)
            advantages = advantages.detach().to(dtype)
            advantages = torch.where(mask if advantages.dim() == 2 else mask.any(-1), advantages, zero)
            # gamma * exp(logp - old_logp) == exp(logp - (old_logp - log gamma)): the loss sees a lowered old_logp
            ratio_old = old_logp if log_weight is None else old_logp - torch.where(mask, log_weight, zero)
            pg_logp = logp
            if rollout_is_weight is not None:  # value logp, gradient w * grad logp (w detached, 0 off the mask)
                w = torch.where(mask, rollout_is_weight, zero)
                pg_logp = logp.detach() + w * (logp - logp.detach())
            loss, metrics = fn(
                pg_logp, ratio_old, advantages, mask,
                clip_low=clip_low, clip_high=clip_high, loss_agg_mode=loss_agg_mode,
                loss_denominator=loss_denominator, log_ratio_clamp=log_ratio_clamp, **options,
            )  # fmt: skip
            if log_weight is not None:
                metrics["ppo_kl"] = ppo_kl(logp, old_logp, mask)
            if ref_logp is not None:
                ref_logp = torch.where(mask, ref_logp.detach().to(dtype), zero)
                kl_BT = kl_penalty(logp, ref_logp, kl_estimator, log_ratio_clamp)
                kl_loss = agg_loss(kl_BT, mask, loss_agg_mode, loss_denominator)
                loss = loss + beta * kl_loss
                metrics["kl_loss"] = kl_loss.detach()
            return loss, metrics

        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = wrapped
        DEFAULT_CLIP[name] = default_clip
        DEFAULT_AGG[name] = default_agg_mode
        if needs_router_shift:
            ROUTER_SHIFT_LOSSES.add(name)
        return wrapped

    return deco
