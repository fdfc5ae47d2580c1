"""A reward for multi-turn episodes on the character tokenizer's template (configs/multiturn_tiny_cpu.yaml): 1 when
the assistant's last turn, the text after the last tool message, is the gold answer, else 0. The tool's own output
earlier in the episode earns nothing: the policy has to say the answer itself.

    rollout:
      reward: examples/rewards/final_turn_answer.py:compute_score
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "\ntool: " not in solution_str:
        return 0.0
    final = solution_str.rsplit("\ntool: ", 1)[1].split("\nassistant: ", 1)[-1]
    return float(final.strip() == str(ground_truth).strip())
