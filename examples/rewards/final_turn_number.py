"""A reward for multi-turn episodes: 1 when the last number of the assistant's last turn equals the answer, else 0.
The text it scores is extra_info["turns"][-1] (the policy's own last turn), not the whole episode, whose tool
messages may hold the answer the policy never said (configs/real_smollm2_tool_cpu.yaml). A single response (no
episode) is scored as it is.

    rollout:
      reward: examples/rewards/final_turn_number.py:compute_score
"""

from __future__ import annotations

from fractions import Fraction

from moe_gspo.rewards.text import last_number


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    turns = (extra_info or {}).get("turns") or [solution_str]
    said = last_number(turns[-1])
    return float(said is not None and said == Fraction(str(ground_truth).strip()))
