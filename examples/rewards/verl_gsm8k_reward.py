"""A GSM8K reward written the way verl calls reward functions: compute_score(data_source, solution_str,
ground_truth, extra_info=None), once per response.

The answer is the number after the last `####` in the response (GSM8K's convention); commas, `$` and a trailing
period are ignored, and it must equal the gold answer as a number. A response without `####` scores 0.

Point a run at it with

    rollout.reward=examples/rewards/verl_gsm8k_reward.py:compute_score

(a path relative to the directory the run starts in). The gold answer is the data row's answer column; `data_source`
and `extra_info` are the row's columns of those names, if it has them.
"""

import re

_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def _number(text):
    """The value of "1,234", "$72" or "-3.5" as a float, or None."""
    try:
        return float(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """{"score": 1.0 or 0.0, "acc": True/False}; only "score" is the reward, "acc" is for the reader."""
    found = _ANSWER.findall(solution_str)
    answer = _number(found[-1]) if found else None
    gold = _number(str(ground_truth))
    correct = answer is not None and gold is not None and abs(answer - gold) < 1e-6
    return {"score": 1.0 if correct else 0.0, "acc": correct}
