"""Verifiable rewards: exact rewards for the synthetic tasks, a math-verify verifier, failure-reporting scoring.

    fn = get_reward_fn("math")                       # or "exact", "countdown"
    result = score_responses(fn, texts, examples)    # NaN + error message for a sample whose fn raised
"""

from __future__ import annotations

from moe_gspo.rewards.math_verifier import math_verify_reward
from moe_gspo.rewards.score import RewardResult, score_responses
from moe_gspo.rewards.synthetic import countdown, countdown_value, exact_match

REWARD_FNS = {"exact": exact_match, "countdown": countdown, "math": math_verify_reward}


def get_reward_fn(name: str):
    """Reward function registered under `name`; an unknown name lists the valid ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; valid: {sorted(REWARD_FNS)}") from None


__all__ = ["REWARD_FNS", "RewardResult", "countdown", "countdown_value", "exact_match", "get_reward_fn",
           "math_verify_reward", "score_responses"]
