"""Score a batch of responses with a reward function, catching and reporting a function that fails on a sample.

    result = score_responses(fn, texts, examples)
    result.rewards      # (N,) float32; NaN where the function failed (never a silent 0)
    result.valid        # (N,) bool
    result.errors       # list[str | None]: "ZeroDivisionError: ..." for the failed samples
    result.metrics()    # {"reward/mean": ..., "reward/errors": 2.0, ...}

A failed sample must be excluded by the caller (for example masked out of its group's advantage); its reward is
NaN precisely so that forgetting to do so shows up instead of training on a made-up score.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class RewardResult:
    rewards: torch.Tensor  # (N,) float32, NaN where the reward function raised or returned a non-number
    valid: torch.Tensor  # (N,) bool
    errors: list[str | None]  # per sample: None, or "<ExceptionType>: message"

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


def score_responses(reward_fn: Callable, responses: Sequence[str], examples: Sequence,
                    warn: bool = True) -> RewardResult:
    """Call `reward_fn(response, example)` per sample; an exception or non-finite value marks that sample failed."""
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
    rewards, errors = [], []
    for i, (text, ex) in enumerate(zip(responses, examples)):
        try:
            r = reward_fn(text, ex)
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise TypeError(f"reward function returned {r!r}, not a finite number")
            rewards.append(float(r))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported per sample, never swallowed
            rewards.append(float("nan"))
            errors.append(f"{type(e).__name__}: {e}")
    result = RewardResult(torch.tensor(rewards, dtype=torch.float32),
                          torch.tensor([e is None for e in errors], dtype=torch.bool), errors)
    if warn and result.num_errors:
        first = next(i for i, e in enumerate(errors) if e is not None)
        name = getattr(reward_fn, "__name__", repr(reward_fn))
        warnings.warn(f"reward function {name} failed on {result.num_errors}/{len(errors)} samples "
                      f"(first: sample {first}: {errors[first]}); their rewards are NaN", stacklevel=2)
    return result
