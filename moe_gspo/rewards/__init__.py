"""Verifiable rewards: built-in reward functions, rewards from a user's file, failure-reporting scoring.

    fn = get_reward_fn("math")                       # a built-in, by name (REWARD_FNS)
    fn = load_reward("my_rewards.py:score")          # a built-in name, or a function in the user's file
    result = score_responses(fn, texts, examples)    # NaN + error message for a sample whose fn raised

The built-ins, each `fn(response, example) -> float` comparing with example.answer (1.0 right, 0.0 wrong):

- "exact": the response equals the answer (surrounding whitespace aside);
- "countdown": an arithmetic expression using example.meta["numbers"] once each that equals meta["target"];
- "math": the final answer is mathematically equivalent to the answer (math-verify);
- "gsm8k": the number after the last `####` equals the answer numerically (`1,234` is 1234);
- "boxed": the last `\\boxed{...}` equals the answer after light normalization (spaces, `$`, `\\left`).
- "last_number": the last number in the response equals the answer numerically.

load_reward (moe_gspo.rewards.user) also takes `path/to/file.py:function`: a function written for verl
(data_source, solution_str, ground_truth, extra_info), for TRL (prompts, completions, **kwargs) or for this
package (response, example). An exception raised in it stops the run with RewardFunctionError, naming the sample.
load_rewards takes a list of either, with weights: each sample's reward is the weighted sum of those that scored it.
"""

from __future__ import annotations

from moe_gspo.rewards.builtin import REWARD_FNS, get_reward_fn
from moe_gspo.rewards.math_verifier import math_verify_reward
from moe_gspo.rewards.score import RewardResult, WeightedRewards, score_responses
from moe_gspo.rewards.synthetic import countdown, countdown_value, exact_match
from moe_gspo.rewards.text import boxed_reward, gsm8k_reward
from moe_gspo.rewards.user import RewardFunctionError, UserReward, load_reward, load_rewards

__all__ = ["REWARD_FNS", "RewardFunctionError", "RewardResult", "UserReward", "WeightedRewards", "boxed_reward",
           "countdown", "countdown_value", "exact_match", "get_reward_fn", "gsm8k_reward", "load_reward",
           "load_rewards", "math_verify_reward", "score_responses"]
