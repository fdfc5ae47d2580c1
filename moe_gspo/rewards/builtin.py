"""The built-in rewards by name (rollout.reward, DatasetTask's reward)."""

from __future__ import annotations

from moe_gspo.rewards.math_verifier import math_verify_reward
from moe_gspo.rewards.synthetic import countdown, exact_match
from moe_gspo.rewards.text import boxed_reward, gsm8k_reward, last_number_reward

REWARD_FNS = {"exact": exact_match, "countdown": countdown, "math": math_verify_reward, "gsm8k": gsm8k_reward,
              "boxed": boxed_reward, "last_number": last_number_reward}


def get_reward_fn(name: str):
    """Reward function registered under `name`; an unknown name lists the valid ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; valid: {sorted(REWARD_FNS)}") from None
