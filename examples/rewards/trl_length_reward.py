"""A reward written the way TRL calls reward functions: reward(prompts, completions, **kwargs), once per batch,
returning one float per completion.

1.0 when the gold answer appears in the completion as a whole number or word (so "72" is not found in "172"),
minus a length penalty of 0.0001 per character, at most 0.1, so that of two correct completions the shorter
scores higher.

Point a run at it with

    rollout.reward=examples/rewards/trl_length_reward.py:reward

(a path relative to the directory the run starts in). `answer` is the gold answer of each row; a chat row's
completion arrives as [{"role": "assistant", "content": text}], a plain row's as the text.
"""

import re

PENALTY_PER_CHAR = 1e-4
MAX_PENALTY = 0.1


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _contains(text, answer):
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w]|\.\d)", text) is not None


def reward(prompts, completions, answer=None, **kwargs):
    answers = answer if answer is not None else [None] * len(completions)
    scores = []
    for completion, gold in zip(completions, answers):
        text = _text(completion)
        correct = gold is not None and _contains(text, str(gold).strip())
        scores.append((1.0 if correct else 0.0) - min(PENALTY_PER_CHAR * len(text), MAX_PENALTY))
    return scores
