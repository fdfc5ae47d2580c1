"""The rollout side as the RL loop sees it, wherever the engines run: one interface, two implementations.

    rollouts = ColocatedRollouts(engine, placement, cfg.rollout.engine_tp)   # or separate.RemoteRollouts
    batch, metrics = rollouts.batch(step, parts_of, group_size)              # this rank's responses of the step
    rollouts.sleep()                                                         # the trainer trains
    rollouts.publish(policy.weights())                                       # the engines sample the new weights
    rollouts.close()

ColocatedRollouts runs the engines on the trainer's own ranks, sampling for the data-parallel ranks its replica
serves (moe_gspo.rollout.placement); RemoteRollouts (moe_gspo.train.separate) receives the batches that engine ranks
of their own sampled, and pushes them each new policy version. The loop holds one and never asks which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from moe_gspo.rollout import RolloutEngine, SamplingParams
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.agent import MultiTurnEngine
from moe_gspo.rollout.placement import EnginePlacement

PromptsOf = Callable[[int], tuple[list[list[int]], SamplingParams]]
"""Data-parallel rank -> that rank's prompts (token ids) and sampling parameters of the step."""


class Rollouts(ABC):
    """What the RL loop asks of the rollout side."""

    @abstractmethod
    def batch(self, step: int, prompts_of: PromptsOf, n_per_prompt: int) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's responses of `step` (n_per_prompt per prompt of its own data-parallel rank) and the metrics
        of how they were made. Collective over the trainer's ranks."""

    def generate(self, prompts_of: PromptsOf, n_per_prompt: int) -> RolloutBatch:
        """Responses to other prompts than a step's (held-out evaluation) from the current weights."""
        raise NotImplementedError(f"{type(self).__name__} samples the steps' prompts only")

    @abstractmethod
    def publish(self, weights) -> None:
        """After an RL step: the engines sample from these weights (a WeightSource) from now on, or from the
        version they stand for, as the placement's schedule says."""

    def sleep(self) -> None:
        """The trainer is about to train: engines that share its device give their memory back (a no-op where
        none does)."""

    def metrics(self) -> dict[str, float]:
        """The engines' figures of the last step (tensor-parallel size, the parameter share a trainer rank keeps,
        weight-sync phases)."""
        return {}

    def close(self) -> None:
        """Release the engines (and meet engine ranks of their own a last time)."""


class ColocatedRollouts(Rollouts):
    """Engines on the trainer's own ranks: each replica of rollout.engine_tp ranks samples the prompts of the
    data-parallel ranks it serves, one after the other with training. The engine is the caller's: close() leaves
    it alone."""

    def __init__(self, engine: RolloutEngine, placement: EnginePlacement, engine_tp: int, dp_rank: int):
        self.engine, self.placement, self.engine_tp, self.dp_rank = engine, placement, engine_tp, dp_rank
        if isinstance(engine, MultiTurnEngine) and placement.replica_group is not None:
            engine.share_tools(placement.replica_group, placement.replica[0])  # the tools run on its first rank

    def batch(self, step: int, prompts_of: PromptsOf, n_per_prompt: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.generate(prompts_of, n_per_prompt), {}

    def generate(self, prompts_of: PromptsOf, n_per_prompt: int) -> RolloutBatch:
        parts = {d: prompts_of(d) for d in self.placement.serves}
        return self.placement.generate(self.engine, parts, n_per_prompt, self.dp_rank)

    def publish(self, weights) -> None:
        self.engine.wake()
        self.engine.update_weights(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def metrics(self) -> dict[str, float]:
        phases = getattr(self.engine, "last_sync_phases", None) or {}
        return {"engine/tp": float(self.engine_tp), "engine/param_fraction": self.engine.param_fraction(),
                **{f"engine/sync_{k}_s": float(v) for k, v in phases.items()}}
