"""What a task is: examples (prompt, gold answer, metadata) drawn with a seed, and the reward that checks them.

Train and held-out prompts never overlap: a stable hash of the prompt text puts `heldout_fraction` of all prompts
in the "test" split, and `sample(rng, split)` only draws from the split asked for.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    prompt: str
    """Text the model is conditioned on (the tokenizer adds bos); for a chat prompt, its messages as text (what
    logs show and the held-out split hashes)."""
    answer: str
    """Gold answer the reward compares against."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    """Task-specific data the reward needs (countdown: numbers, target)."""
    demonstration: str | list | None = field(default=None, hash=False)
    """Gold completion for supervised cold start; None means `answer`. A list: the episode's assistant and tool
    messages ([{"role": "assistant", ...}, {"role": "tool", ...}, ..., {"role": "assistant", ...}])."""
    messages: list | None = field(default=None, compare=False, hash=False)
    """A chat prompt as the data set holds it: [{"role": ..., "content": ...}, ...]; the tokenizer's chat template
    turns it into ids (rollout.chat_template). None: `prompt` is used as it is."""

    @property
    def completion(self) -> str:
        """The demonstration's text: its last assistant turn when it is a list of messages."""
        if self.demonstration is None:
            return self.answer
        return self.demonstration if isinstance(self.demonstration, str) else self.demonstration[-1]["content"]


def in_heldout(prompt: str, fraction: float) -> bool:
    """Stable (process-independent) assignment of a prompt to the held-out split."""
    return (zlib.crc32(prompt.encode()) % 10_000) < int(round(fraction * 10_000))


class Task:
    """Base class: subclasses implement `_draw(rng) -> Example`; `reward_fn(response, example) -> float`."""

    name: str = "task"
    reward_fn: Callable[[str, Example], float]
    heldout_fraction: float = 0.1
    has_demonstrations: bool = True
    """Whether examples carry a gold completion the cold start can train on (a synthetic task's answer is one)."""

    def _draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def sample(self, rng: random.Random, split: str = "train") -> Example:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is not one of ['train', 'test']")
        want_test = split == "test"
        for _ in range(10_000):
            ex = self._draw(rng)
            if in_heldout(ex.prompt, self.heldout_fraction) == want_test:
                return ex
        raise RuntimeError(f"task {self.name}: could not draw a {split!r} example (heldout_fraction="
                           f"{self.heldout_fraction})")

    def examples(self, n: int, seed: int = 0, split: str = "train") -> list[Example]:
        rng = random.Random(seed)
        return [self.sample(rng, split) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        """n held-out examples for evaluation during training (the same ones every time; 0: 64)."""
        return self.examples(n or 64, seed=1234, split="test")

    def reward(self, response: str, example: Example) -> float:
        return self.reward_fn(response, example)
