"""The policy-loss object: one registered class per loss, holding its defaults, its options and its math.

    @register_policy_loss
    class MyLoss(PolicyLoss):
        name = "my_loss"                      # algorithm.loss: my_loss
        default_clip = (0.2, 0.28)            # clip_low / clip_high when the config leaves them None
        Options = MyOptions                   # a dataclass: algorithm.loss_options, checked at config load
        fn = staticmethod(my_loss_fn)         # the math: (logp, old_logp, advantages, mask, *, clip_low, ...)

    loss = build_policy_loss("gspo", clip_low=3e-4)          # or policy_loss_from_config(cfg.algorithm)
    value, metrics = loss(logp, old_logp, advantages, mask, loss_denominator=D)

A class states what the trainer needs to know about it: its clip defaults and clip space ("ratio", or "log" for
gmpo/rspo, which bound the log-ratio to [-clip_low, clip_high]), its aggregation default and the modes it accepts,
whether it needs the router-shift weight (rspo), whether its importance ratio is per token or per sequence (the
engine's log-probs as pi_old are sound for sequence ratios), and its own options. Its constructor checks every
hyperparameter and raises LossConfigError naming the field, which config load turns into one line.

Calling a loss applies the input handling every loss shares:
  - the padded [B, T] layout or the packed one (cu_seqlens=[B + 1], tensors [total] or [1, total]),
  - shape checks, and a finiteness check of logp, old_logp, ref_logp and advantages at response positions
    (one host sync per call; check_finite=False skips it), raising ValueError naming the tensor,
  - everything off the mask is ignored (padding may hold garbage, even NaN),
  - the optional k3 KL to a reference policy, beta * agg(exp(ref - logp) - (ref - logp) - 1),
  - an optional per-token router-shift weight gamma [B, T] (RSPO, arXiv:2510.23027): the importance ratio
    w = exp(logp - old_logp) becomes gamma * w before the loss clips and aggregates it. That equals lowering old_logp
    by log gamma, which is how it is applied, so every loss takes the weight without code of its own; `ppo_kl` is
    still measured against the true old_logp, while the ratio stats describe the rescaled ratios the loss clips,
  - an optional per-token rollout-correction weight w [B, T] (rollout_correction.py): a detached multiplier of
    each token's gradient. The loss sees logp' = sg[logp] + w (logp - sg[logp]), equal to logp in value (so
    clipping, ratios and metrics are unchanged) with d logp' / d logp = w. The KL term is not weighted.

`get_policy_loss(name)` is the functional form for one-off calls (tests, benchmarks, the fused kernel's users):
fn(logp, old_logp, advantages, mask, clip_low=..., **per_call) builds the loss from the keyword hyperparameters and
applies it once. Unknown names raise ValueError listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from moe_gspo.losses.aggregation import AGG_MODES, agg_loss
from moe_gspo.losses.packed import check_cu_seqlens, pad_packed

LOG_RATIO_CLAMP = 20.0  # |log-ratio| is clamped to this before exp (exp(20) ~ 4.9e8, finite in fp16/bf16/fp32)
DEFAULT_AGG_MODE = "seq-mean-token-mean"  # the paper's 1/G sum_i 1/|y_i| sum_t, for all three losses

POLICY_LOSSES: dict[str, type[PolicyLoss]] = {}  # name -> class, filled by register_policy_loss


class LossConfigError(ValueError):
    """A bad hyperparameter of a policy loss; `field` names it as the algorithm config does (clip_low,
    loss_agg_mode, loss_options.tau_pos, ...)."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why


def policy_loss_class(name: str) -> type[PolicyLoss]:
    """The loss class registered as `name`; unknown names raise LossConfigError listing the valid ones."""
    if name not in POLICY_LOSSES:
        raise LossConfigError("loss", name, f"unknown policy loss; valid names: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def build_policy_loss(name: str, **hyper) -> PolicyLoss:
    """The loss registered as `name` built with keyword hyperparameters (PolicyLoss's constructor)."""
    return policy_loss_class(name)(**hyper)


def policy_loss_from_config(a) -> PolicyLoss:
    """The loss an AlgorithmConfig asks for: algorithm.loss with its clip, aggregation, KL and loss_options."""
    return build_policy_loss(a.loss, clip_low=a.clip_low, clip_high=a.clip_high, loss_agg_mode=a.loss_agg_mode,
                             beta=a.kl_beta, kl_estimator=a.kl_estimator, options=a.loss_options)


_HYPER = ("clip_low", "clip_high", "loss_agg_mode", "beta", "kl_estimator", "log_ratio_clamp")


def loss_with_call_kwargs(name: str, kw: dict) -> tuple[PolicyLoss, dict]:
    """(loss `name` built from the hyperparameters and options among kw, the rest of kw: the per-call keywords)."""
    cls = policy_loss_class(name)
    option_names = {f.name for f in dataclasses.fields(cls.Options)}
    hyper = {k: v for k, v in kw.items() if k in _HYPER}
    options = {k: v for k, v in kw.items() if k in option_names}
    rest = {k: v for k, v in kw.items() if k not in hyper and k not in options}
    return cls(**hyper, options=options), rest


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The functional form of loss `name`: fn(logp, old_logp, advantages, mask, **kw) builds the loss from the
    hyperparameters among kw (clip_low, clip_high, loss_agg_mode, beta, kl_estimator, log_ratio_clamp, and the
    loss's own options by name) and applies it to the rest (loss_denominator, ref_logp, router_shift_weight,
    rollout_is_weight, cu_seqlens, max_seqlen, check_finite)."""
    policy_loss_class(name)  # an unknown name fails here, not at the first call

    def fn(logp, old_logp, advantages, mask, **kw):
        loss, per_call = loss_with_call_kwargs(name, kw)
        return loss(logp, old_logp, advantages, mask, **per_call)

    fn.__name__ = fn.__qualname__ = f"{name}_loss"
    return fn


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


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a loss that has none beyond the shared hyperparameters."""


def _options(cls, options) -> Any:
    """cls.Options from a dict (the config's algorithm.loss_options) or an instance; LossConfigError naming the
    option when one is unknown or its value is refused (the dataclass's __post_init__ raising ValueError)."""
    if isinstance(options, cls.Options):
        return options
    options = dict(options or {})
    names = [f.name for f in dataclasses.fields(cls.Options)]
    for k, v in options.items():
        if k not in names:
            have = f"its options: {', '.join(names)}" if names else "it takes none"
            raise LossConfigError(f"loss_options.{k}", v, f"{cls.name} has no option {k!r} ({have})")
    for f in dataclasses.fields(cls.Options):  # YAML reads "3e-4" as a string: numbers for float fields
        if f.name in options and isinstance(options[f.name], str) and "float" in str(f.type):
            try:
                options[f.name] = float(options[f.name])
            except ValueError:
                pass
    try:
        return cls.Options(**options)
    except LossConfigError:
        raise
    except (TypeError, ValueError) as e:
        bad = next((k for k in names if k in str(e)), None)
        field = f"loss_options.{bad}" if bad else "loss_options"
        raise LossConfigError(field, options.get(bad, options) if bad else options, str(e)) from None


class PolicyLoss:
    """A policy loss: its defaults and what it needs (class attributes), its hyperparameters (the instance), its
    math (`fn`, a pure function of padded [B, T] tensors). Subclass, set the class attributes, register."""

    name: ClassVar[str]
    default_clip: ClassVar[tuple[float, float]]
    clip_space: ClassVar[str] = "ratio"  # "ratio": w in [1 - clip_low, 1 + clip_high]; "log": log w in [-lo, hi]
    open_low: ClassVar[bool] = False  # clip_low may be 1 (no lower bound on the ratio)
    default_agg_mode: ClassVar[str] = DEFAULT_AGG_MODE
    agg_modes: ClassVar[tuple[str, ...]] = AGG_MODES
    needs_router_shift: ClassVar[bool] = False  # calls without router_shift_weight are refused (rspo)
    ratio_level: ClassVar[str] = "token"  # "token" or "sequence": what one importance ratio covers
    Options: ClassVar[type] = NoOptions
    fn: ClassVar[Callable[..., tuple[Tensor, dict[str, Tensor]]]]

    def __init__(self, clip_low: float | None = None, clip_high: float | None = None,
                 loss_agg_mode: str | None = None, *, beta: float = 0.0, kl_estimator: str = "k3",
                 log_ratio_clamp: float = LOG_RATIO_CLAMP, options=None):
        name = self.name
        self.clip_low = self.default_clip[0] if clip_low is None else float(clip_low)
        self.clip_high = self.default_clip[1] if clip_high is None else float(clip_high)
        lo, hi = self.clip_low, self.clip_high
        if self.clip_space == "ratio":
            low_ok = lo <= 1.0 if self.open_low else lo < 1.0
            if not (0.0 <= lo and low_ok):
                raise LossConfigError("clip_low", lo, f"{name} needs 0 <= clip_low {'<=' if self.open_low else '<'} "
                                      f"1 (the ratio's lower bound is 1 - clip_low)")
            if not hi >= 0.0:
                raise LossConfigError("clip_high", hi, f"{name} needs clip_high >= 0")
        else:
            for field, v in (("clip_low", lo), ("clip_high", hi)):
                if not 0.0 <= v < math.inf:
                    raise LossConfigError(field, v, f"{name} bounds the log-ratio: it must be finite and >= 0")
        self.loss_agg_mode = self.default_agg_mode if loss_agg_mode is None else loss_agg_mode
        if self.loss_agg_mode not in self.agg_modes:
            raise LossConfigError("loss_agg_mode", self.loss_agg_mode, f"{name} accepts {', '.join(self.agg_modes)}")
        if not beta >= 0:
            raise LossConfigError("kl_beta", beta, "must be >= 0")
        if kl_estimator not in KL_ESTIMATORS:
            raise LossConfigError("kl_estimator", kl_estimator, f"valid names: {', '.join(KL_ESTIMATORS)}")
        self.beta, self.kl_estimator, self.log_ratio_clamp = float(beta), kl_estimator, log_ratio_clamp
        self.options = _options(type(self), options)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, clip=({self.clip_low}, {self.clip_high}), "
                f"agg={self.loss_agg_mode!r}, beta={self.beta}, options={self.options})")

    def objective(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  loss_denominator) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss's own math on masked, padded inputs (see the module docstring of policy.py for the shapes)."""
        return type(self).fn(logp, old_logp, advantages, mask, clip_low=self.clip_low, clip_high=self.clip_high,
                             loss_agg_mode=self.loss_agg_mode, loss_denominator=loss_denominator,
                             log_ratio_clamp=self.log_ratio_clamp, **dataclasses.asdict(self.options))

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 loss_denominator: Tensor | float | None = None, ref_logp: Tensor | None = None,
                 router_shift_weight: Tensor | None = None, rollout_is_weight: Tensor | None = None,
                 cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
                 check_finite: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss 0-dim, metrics of detached 0-dim tensors); shapes as in the module docstring."""
        name = self.name
        if self.beta != 0.0 and ref_logp is None:
            raise ValueError(f"{name}: beta={self.beta} needs ref_logp (reference policy log-probs)")
        if self.needs_router_shift and router_shift_weight is None:
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
        loss, metrics = self.objective(pg_logp, ratio_old, advantages, mask, loss_denominator)
        if log_weight is not None:
            metrics["ppo_kl"] = ppo_kl(logp, old_logp, mask)
        if ref_logp is not None:
            ref_logp = torch.where(mask, ref_logp.detach().to(dtype), zero)
            kl_BT = kl_penalty(logp, ref_logp, self.kl_estimator, self.log_ratio_clamp)
            kl_loss = agg_loss(kl_BT, mask, self.loss_agg_mode, loss_denominator)
            loss = loss + self.beta * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        return loss, metrics


def register_policy_loss(cls: type[PolicyLoss]) -> type[PolicyLoss]:
    """Class decorator: register a PolicyLoss subclass under its `name` (algorithm.loss)."""
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        raise TypeError(f"register_policy_loss takes a PolicyLoss subclass, got {cls!r}")
    for attr in ("name", "default_clip", "fn"):
        if not hasattr(cls, attr):
            raise TypeError(f"{cls.__name__} must set {attr}")
    if cls.name in POLICY_LOSSES:
        raise ValueError(f"policy loss {cls.name!r} is already registered")
    if cls.clip_space not in ("ratio", "log") or cls.ratio_level not in ("token", "sequence"):
        raise ValueError(f"{cls.__name__}: clip_space must be 'ratio' or 'log' and ratio_level 'token' or 'sequence'")
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"{cls.__name__}.Options must be a dataclass")
    POLICY_LOSSES[cls.name] = cls
    return cls
