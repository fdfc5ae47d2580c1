"""Score a batch of responses with a reward function, catching and reporting a function that fails on a sample.

    result = score_responses(fn, texts, examples)
    result.rewards      # (N,) float32; NaN where the function failed (never a silent 0)
    result.valid        # (N,) bool
    result.errors       # list[str | None]: "ZeroDivisionError: ..." for the failed samples
    result.metrics()    # {"reward/mean": ..., "reward/errors": 2.0, ...}

A per-sample function `fn(response, example)` is called once per sample; an object with `batched = True` (a user's
function, moe_gspo.rewards.user) is called once, as `fn.score_batch(responses, examples)`, and returns one reward or
None per sample. A UserError (a user's reward function that raised) is not a failed sample: it stops the run.

A failed sample must be excluded by the caller (for example masked out of its group's advantage); its reward is
NaN precisely so that forgetting to do so shows up instead of training on a made-up score.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_gspo.config.checks import UserError


@dataclass
class RewardResult:
    rewards: torch.Tensor  # (N,) float32, NaN where the reward function raised or returned a non-number
    valid: torch.Tensor  # (N,) bool
    errors: list[str | None]  # per sample: None, or why it has no reward ("<ExceptionType>: message")

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
    """(rewards, errors): reward_fn(response, example) per sample; an exception or non-number fails that sample."""
    rewards, errors = [], []
    for text, ex in zip(responses, examples):
        try:
            r = reward_fn(text, ex)
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise TypeError(f"reward function returned {r!r}, not a finite number")
            rewards.append(float(r))
            errors.append(None)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - reported per sample, never swallowed
            rewards.append(float("nan"))
            errors.append(f"{type(e).__name__}: {e}")
    return rewards, errors


def _score_batched(reward_fn, responses: Sequence[str], examples: Sequence):
    """(rewards, errors): one reward_fn.score_batch call; a None or non-finite reward fails that sample."""
    values = reward_fn.score_batch(list(responses), list(examples))
    if len(values) != len(responses):
        raise ValueError(f"{reward_fn!r} returned {len(values)} rewards for {len(responses)} responses")
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    ok = [v is not None and math.isfinite(v) for v in values]
    rewards = [float(v) if good else float("nan") for v, good in zip(values, ok)]
    errors = [None if good else f"reward function {name} returned {v!r}" for v, good in zip(values, ok)]
    return rewards, errors


def score_responses(reward_fn: Callable, responses: Sequence[str], examples: Sequence,
                    warn: bool = True) -> RewardResult:
    """Score every sample with `reward_fn` (per sample, or in one call when it is batched); an exception or
    non-finite value marks that sample failed, except a UserError, which propagates."""
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
    score = _score_batched if getattr(reward_fn, "batched", False) else _score_each
    rewards, errors = score(reward_fn, responses, examples)
    result = RewardResult(torch.tensor(rewards, dtype=torch.float32),
                          torch.tensor([e is None for e in errors], dtype=torch.bool), errors)
    if warn and result.num_errors:
        first = next(i for i, e in enumerate(errors) if e is not None)
        name = getattr(reward_fn, "__name__", repr(reward_fn))
        warnings.warn(f"reward function {name} failed on {result.num_errors}/{len(errors)} samples "
                      f"(first: sample {first}: {errors[first]}); their rewards are NaN", stacklevel=2)
    return result
