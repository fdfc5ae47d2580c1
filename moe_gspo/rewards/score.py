"""Score a batch of responses with a reward function, catching and reporting a function that fails on a sample.

    result = score_responses(fn, texts, examples)
    result.rewards      # (N,) float32; NaN where the function failed (never a silent 0)
    result.valid        # (N,) bool
    result.errors       # list[str | None]: "ZeroDivisionError: ..." for the failed samples
    result.metrics()    # {"reward/mean": ..., "reward/errors": 2.0, ...}
    result = score_responses(WeightedRewards([f, g], [1.0, 0.5], ["math", "format"]), texts, examples)
    result.components   # {"reward/math/mean": ..., "reward/format/none": 3.0, ...}

A per-sample function `fn(response, example)` is called once per sample; an object with `batched = True` (a user's
function, moe_gspo.rewards.user) is called once, as `fn.score_batch(responses, examples)`, and returns one reward or
None per sample. A UserError (a user's reward function that raised) is not a failed sample: it stops the run.

Several reward functions (WeightedRewards, TRL's reward_funcs and reward_weights) give each sample the weighted sum
of the functions that scored it. A function returning None for a sample does not score it (TRL's convention: a
reward that applies only to some rows); a sample no function scored, or one a function failed on (an exception, NaN
or inf), has no reward.

A failed sample must be excluded by the caller (for example masked out of its group's advantage); its reward is
NaN precisely so that forgetting to do so shows up instead of training on a made-up score.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moe_gspo.config.checks import UserError


@dataclass
class RewardResult:
    rewards: torch.Tensor  # (N,) float32, NaN where the reward function raised or returned a non-number
    valid: torch.Tensor  # (N,) bool
    errors: list[str | None]  # per sample: None, or why it has no reward ("<ExceptionType>: message")
    absent: torch.Tensor | None = None  # (N,) bool: the function returned None (did not score the sample)
    by_function: dict[str, RewardResult] = field(default_factory=dict)  # several functions: each one's own result

    @property
    def components(self) -> dict[str, float]:
        """With several reward functions, each one's mean over the samples it scored and its count of Nones."""
        out = {}
        for name, r in self.by_function.items():
            ok = r.rewards[r.valid]
            out[f"reward/{name}/mean"] = float(ok.mean()) if ok.numel() else float("nan")
            out[f"reward/{name}/none"] = float(r.absent.sum())
        return out

    def select(self, idx: torch.Tensor) -> RewardResult:
        """The samples at positions idx, in that order."""
        return RewardResult(self.rewards[idx], self.valid[idx], [self.errors[i] for i in idx.tolist()],
                            None if self.absent is None else self.absent[idx],
                            {k: r.select(idx) for k, r in self.by_function.items()})

    @staticmethod
    def concat(parts: list[RewardResult]) -> RewardResult:
        """The samples of parts one after the other (the parts come from the same reward functions)."""
        absent = None if any(r.absent is None for r in parts) else torch.cat([r.absent for r in parts])
        by_function = {k: RewardResult.concat([r.by_function[k] for r in parts]) for k in parts[0].by_function}
        return RewardResult(torch.cat([r.rewards for r in parts]), torch.cat([r.valid for r in parts]),
                            [e for r in parts for e in r.errors], absent, by_function)

    @property
    def num_errors(self) -> int:
        return sum(e is not None for e in self.errors)

    def metrics(self) -> dict[str, float]:
        ok = self.rewards[self.valid]
        return {
            "reward/mean": float(ok.mean()) if ok.numel() else float("nan"),
            "reward/std": float(ok.std(unbiased=False)) if ok.numel() else float("nan"),
            "reward/errors": float(self.num_errors),
        }


def _score_each(reward_fn: Callable, responses: Sequence[str], examples: Sequence):
    """(rewards, errors, absent): reward_fn(response, example) per sample; an exception or non-number fails that
    sample, None leaves it without a reward from this function (absent)."""
    rewards, errors, absent = [], [], []
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    for text, ex in zip(responses, examples):
        try:
            r = reward_fn(text, ex)
            if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
                raise TypeError(f"reward function returned {r!r}, not a finite number")
            rewards.append(float("nan") if r is None else float(r))
            errors.append(f"reward function {name} returned None" if r is None else None)
            absent.append(r is None)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - reported per sample, never swallowed
            rewards.append(float("nan"))
            errors.append(f"{type(e).__name__}: {e}")
            absent.append(False)
    return rewards, errors, absent


def _score_batched(reward_fn, responses: Sequence[str], examples: Sequence):
    """(rewards, errors, absent): one reward_fn.score_batch call; a None or non-finite reward fails that sample,
    None being absent (no reward from this function)."""
    values = reward_fn.score_batch(list(responses), list(examples))
    if len(values) != len(responses):
        raise ValueError(f"{reward_fn!r} returned {len(values)} rewards for {len(responses)} responses")
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    ok = [v is not None and math.isfinite(v) for v in values]
    rewards = [float(v) if good else float("nan") for v, good in zip(values, ok)]
    errors = [None if good else f"reward function {name} returned {v!r}" for v, good in zip(values, ok)]
    return rewards, errors, [v is None for v in values]


class WeightedRewards:
    """Several reward functions scored together; a sample's reward is sum_i weight_i * reward_i over the functions
    that scored it (score_responses)."""

    def __init__(self, fns: Sequence[Callable], weights: Sequence[float], names: Sequence[str]):
        if not len(fns) == len(weights) == len(names) or not fns:
            raise ValueError(f"{len(fns)} reward functions, {len(weights)} weights, {len(names)} names")
        self.fns, self.weights, self.names = list(fns), [float(w) for w in weights], list(names)
        self.__name__ = "+".join(self.names)


def _score_one(reward_fn, responses: Sequence[str], examples: Sequence) -> RewardResult:
    score = _score_batched if getattr(reward_fn, "batched", False) else _score_each
    rewards, errors, absent = score(reward_fn, responses, examples)
    return RewardResult(torch.tensor(rewards, dtype=torch.float32),
                        torch.tensor([e is None for e in errors], dtype=torch.bool), errors,
                        torch.tensor(absent, dtype=torch.bool))


def _combine(rewards: WeightedRewards, parts: list[RewardResult]) -> RewardResult:
    """The weighted sum over the functions that scored each sample; a failure in any function, or no function
    scoring it, leaves the sample without a reward."""
    scored = torch.stack([p.valid for p in parts])  # (F, N)
    failed = torch.stack([~p.valid & ~p.absent for p in parts])  # (F, N): raised, NaN or inf
    w = torch.tensor(rewards.weights, dtype=torch.float32)[:, None]
    total = (w * torch.where(scored, torch.stack([p.rewards for p in parts]), 0.0)).sum(0)
    valid = scored.any(0) & ~failed.any(0)
    errors: list[str | None] = []
    for i in range(total.numel()):
        bad = [f"{name}: {p.errors[i]}" for name, p, f in zip(rewards.names, parts, failed[:, i]) if f]
        errors.append(bad[0] if bad else None if valid[i] else
                      f"none of the reward functions {', '.join(rewards.names)} scored it (each returned None)")
    return RewardResult(torch.where(valid, total, float("nan")), valid, errors, ~scored.any(0) & ~failed.any(0),
                        dict(zip(rewards.names, parts)))


def score_responses(reward_fn: Callable, responses: Sequence[str], examples: Sequence,
                    warn: bool = True) -> RewardResult:
    """Score every sample with `reward_fn` (per sample, or in one call when it is batched; each function of a
    WeightedRewards); an exception or non-finite value marks that sample failed, except a UserError, which
    propagates."""
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
    if isinstance(reward_fn, WeightedRewards):
        result = _combine(reward_fn, [_score_one(f, responses, examples) for f in reward_fn.fns])
    else:
        result = _score_one(reward_fn, responses, examples)
    errors = result.errors
    if warn and result.num_errors:
        first = next(i for i, e in enumerate(errors) if e is not None)
        name = getattr(reward_fn, "__name__", repr(reward_fn))
        warnings.warn(f"reward function {name} failed on {result.num_errors}/{len(errors)} samples "
                      f"(first: sample {first}: {errors[first]}); their rewards are NaN", stacklevel=2)
    return result
