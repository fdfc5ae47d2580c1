"""Registry of policy losses and the input handling shared by all of them.

`register_policy_loss(name, default_clip=...)` wraps a pure loss function so that every registered loss:
  - takes clip_low / clip_high = None to mean the paper's default (DEFAULT_CLIP[name]),
  - accepts the padded [B, T] layout or the packed layout (cu_seqlens=[B + 1], tensors [total] or [1, total]),
  - checks shapes, and checks that logp, old_logp, ref_logp and advantages are finite at response positions
    (one host sync per call; check_finite=False skips it), raising ValueError naming the tensor,
  - ignores everything off the mask (padding may hold garbage, even NaN),
  - adds the optional k3 KL to a reference policy, beta * agg(exp(ref - logp) - (ref - logp) - 1).
`get_policy_loss(name)` returns the wrapped function; an unknown name raises ValueError listing valid names.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import agg_loss, check_agg_mode
from moe_gspo.losses.packed import check_cu_seqlens, pad_packed

LOG_RATIO_CLAMP = 20.0  # |log-ratio| is clamped to this before exp (exp(20) ~ 4.9e8, finite in fp16/bf16/fp32)
DEFAULT_AGG_MODE = "seq-mean-token-mean"  # the paper's 1/G sum_i 1/|y_i| sum_t, for all three losses

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
DEFAULT_CLIP: dict[str, tuple[float, float]] = {}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss registered as `name` ("grpo", "gspo", "gspo_token"); unknown names raise ValueError."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


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
        raise ValueError(f"policy loss inputs contain NaN or inf at response (mask=True) positions: {', '.join(names)}")


def _check_shapes(name: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp) -> None:
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be [B, T] (or packed with cu_seqlens), got shape {tuple(logp.shape)}")
    for tname, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name}: {tname} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"{name}: advantages must be [B] = {list(logp.shape[:1])} or [B, T] = {list(logp.shape)}, "
            f"got {list(advantages.shape)}"
        )


def _to_padded(cu_seqlens: Tensor, max_seqlen, logp, old_logp, advantages, mask, ref_logp):
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
    return pad(logp, "logp"), pad(old_logp, "old_logp"), adv, pad(mask, "mask"), pad(ref_logp, "ref_logp")


def register_policy_loss(name: str, *, default_clip: tuple[float, float]):
    """Decorator: wrap a pure loss `fn` with the shared input handling and register it as `name`."""

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
            loss_agg_mode: str = DEFAULT_AGG_MODE,
            loss_denominator: Tensor | float | None = None,
            ref_logp: Tensor | None = None,
            beta: float = 0.0,
            kl_estimator: str = "k3",
            log_ratio_clamp: float = LOG_RATIO_CLAMP,
            cu_seqlens: Tensor | None = None,
            max_seqlen: int | None = None,
            check_finite: bool = True,
            **options,
        ) -> tuple[Tensor, dict[str, Tensor]]:
            clip_low = default_clip[0] if clip_low is None else float(clip_low)
            clip_high = default_clip[1] if clip_high is None else float(clip_high)
            if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
                raise ValueError(f"{name}: need 0 <= clip_low < 1 and clip_high >= 0, got ({clip_low}, {clip_high})")
            check_agg_mode(loss_agg_mode)
            if beta != 0.0 and ref_logp is None:
                raise ValueError(f"{name}: beta={beta} needs ref_logp (reference policy log-probs)")
            if cu_seqlens is not None:
                logp, old_logp, advantages, mask, ref_logp = _to_padded(
                    cu_seqlens, max_seqlen, logp, old_logp, advantages, mask, ref_logp
                )
            _check_shapes(name, logp, old_logp, advantages, mask, ref_logp)
            mask = mask.bool()
            dtype = torch.promote_types(logp.dtype, torch.float32)
            inputs = {"logp": logp, "old_logp": old_logp, "advantages": advantages}
            if ref_logp is not None:
                inputs["ref_logp"] = ref_logp
            if check_finite:
                _check_finite(inputs, mask)
            zero = logp.new_zeros((), dtype=dtype)
            logp = torch.where(mask, logp.to(dtype), zero)
            old_logp = torch.where(mask, old_logp.detach().to(dtype), zero)
            advantages = advantages.detach().to(dtype)
            advantages = torch.where(mask if advantages.dim() == 2 else mask.any(-1), advantages, zero)
            loss, metrics = fn(
                logp, old_logp, advantages, mask,
                clip_low=clip_low, clip_high=clip_high, loss_agg_mode=loss_agg_mode,
                loss_denominator=loss_denominator, log_ratio_clamp=log_ratio_clamp, **options,
            )  # fmt: skip
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
        return wrapped

    return deco
