"""Dynamic sampling (DAPO's group filter): train only on groups whose rewards differ, refilled to the batch size.

    scored = run.rollout(step)                                   # Scored: the batch, its examples, texts, rewards
    scored, m = fill_groups(scored, lambda r: run.rollout(step, refill=r), prompts=P, group_size=G,
                            max_rounds=rollout.dynamic_sampling_max_rounds, group=trainer_group)

A group whose rewards are all equal (every response right, or every one wrong) has group-relative advantages of 0
and gives no policy gradient; it only dilutes the batch. DAPO (Yu et al., 2025, section 3.2) drops such groups
and samples more prompts until the batch is full again, as verl's `algorithm.filter_groups` does. Here each extra
round samples a fresh set of the step's size (rollout.prompts_per_step prompts), keeps its groups with reward
variance, and stops once every data-parallel rank has its prompts' worth. The ranks run the same number of rounds
(a max over the trainer's ranks after each), since engines shared between ranks sample together.

When the rounds run out first, the batch is completed with the groups that were dropped, earliest first: they
carry no gradient, and the batch keeps its shape (minibatches and micro-batches cut it as they cut any other).
verl stops the run there instead; a week-long run keeps going and logs how often it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_gspo.parallel.state import max_over_ranks
from moe_gspo.rewards.score import RewardResult
from moe_gspo.rollout.batch import RolloutBatch


@dataclass
class Scored:
    """A rollout batch with what was made of it before advantages: one example, text and reward per response,
    responses grouped by prompt (group_size consecutive responses each)."""

    batch: RolloutBatch
    examples: list  # per response, the Example of its prompt
    texts: list[str]  # per response, the decoded response
    rewards: RewardResult  # the reward functions' scores (NaN where a sample has none)
    valid: torch.Tensor  # (N,) bool: a reward the run trains on (rollout.bad_reward=skip drops the others)
    penalty: torch.Tensor  # (N,) float32: the length shaping added to each reward (0 without it)

    @property
    def shaped(self) -> torch.Tensor:
        """(N,) float32: the rewards advantages are computed from, length shaping added."""
        return self.rewards.rewards + self.penalty

    def with_variance(self, group_size: int) -> list[bool]:
        """Per group: whether its valid responses' rewards differ (a group with one valid response has none)."""
        out = []
        for g in range(len(self.texts) // group_size):
            sl = slice(g * group_size, (g + 1) * group_size)
            r = self.shaped[sl][self.valid[sl]]
            out.append(r.numel() > 1 and bool((r != r[0]).any()))
        return out

    def groups(self, picks: list[int], group_size: int) -> Scored:
        """The groups at positions `picks`, in that order."""
        rows = [g * group_size + i for g in picks for i in range(group_size)]
        idx = torch.tensor(rows, dtype=torch.long)
        return Scored(self.batch.select(rows), [self.examples[i] for i in rows], [self.texts[i] for i in rows],
                      self.rewards.select(idx), self.valid[idx], self.penalty[idx])

    @staticmethod
    def concat(parts: list[Scored], group_size: int) -> Scored:
        """The parts one after the other, groups renumbered 0, 1, ... in order."""
        batch = RolloutBatch.concat([p.batch for p in parts])
        n = len(batch)
        batch.group_ids = torch.arange(n // group_size).repeat_interleave(group_size)
        rewards = RewardResult.concat([p.rewards for p in parts])
        return Scored(batch, [e for p in parts for e in p.examples], [t for p in parts for t in p.texts], rewards,
                      torch.cat([p.valid for p in parts]), torch.cat([p.penalty for p in parts]))


def fill_groups(first: Scored, more: Callable[[int], Scored], prompts: int, group_size: int, max_rounds: int,
                group) -> tuple[Scored, dict[str, float]]:
    """(a batch of `prompts` groups with reward variance where the rounds allow, its metrics): `first` filtered,
    then refill rounds more(1), more(2), ... (at most max_rounds - 1 of them) until every rank of `group` has
    `prompts` such groups; dropped groups complete the batch when the rounds run out."""
    kept, dropped, generated, rounds = [], [], 0, 1
    scored = first
    while True:
        spread = scored.with_variance(group_size)
        generated += len(spread)
        kept += [(scored, g) for g, ok in enumerate(spread) if ok]
        dropped += [(scored, g) for g, ok in enumerate(spread) if not ok]
        if rounds >= max_rounds or max_over_ranks(max(prompts - len(kept), 0), group) == 0:
            break
        scored = more(rounds)
        rounds += 1
    chosen = (kept + dropped)[:prompts]
    parts = [src.groups([g], group_size) for src, g in chosen]
    out = Scored.concat(parts, group_size)
    filler = max(prompts - len(kept), 0)
    return out, {"dynamic_sampling/rounds": float(rounds),
                 "dynamic_sampling/kept_fraction": len(kept) / max(generated, 1),
                 "dynamic_sampling/filler_groups": float(filler)}
