"""Who samples which prompts: engine replicas over the trainer's ranks, and the delivery of their samples.

    placement = EnginePlacement.build(engine_tp=2, dp_rank=info.dp_rank, tp_group=groups.tp)
    for d in placement.serves: parts[d] = (prompts of data-parallel rank d, its SamplingParams)
    batch = placement.generate(engine, parts, n_per_prompt, my_dp_rank=info.dp_rank)

The world splits into replicas of `engine_tp` consecutive ranks (vLLM's own tensor-parallel groups under
external_launcher). The prompts of data-parallel rank d are sampled once, by the replica holding the lowest global
rank with data-parallel rank d; every other rank training on them receives that result:
1. within the replica, the batches its rank 0 produced are broadcast to its other ranks (all ranks of a
   tensor-parallel engine run it together and would produce the same tokens; the broadcast makes that a fact rather
   than an assumption, e.g. for GPU kernels that sample non-deterministically);
2. within the trainer's tensor-parallel group (the ranks that train on one data-parallel rank's samples), from its
   first rank, when that group spans several replicas (always when engine_tp = 1 and parallel.tp > 1).
So the ranks of one tensor-parallel forward always train on the same tokens, and no prompt is sampled twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe_gspo.parallel.state import WORLD
from moe_gspo.rollout.base import RolloutEngine, SamplingParams, replicas
from moe_gspo.rollout.batch import RolloutBatch


def assign_engines(dp: int, engines: int, home: list[int | None] | None = None) -> list[list[int]]:
    """The data-parallel ranks each of `engines` engines samples for, by engine: a rank's prompts go to its home
    engine where it has one (colocated: the replica that holds the rank's first member, `home[d]`), else to engine
    d mod engines (engines on ranks of their own, which hold no trainer rank). The one rule both placements use."""
    out: list[list[int]] = [[] for _ in range(engines)]
    for d in range(dp):
        e = home[d] if home is not None and home[d] is not None else d % engines
        out[e].append(d)
    return out


@dataclass
class EnginePlacement:
    engine_tp: int
    rank: int
    serves: list[int]  # data-parallel ranks whose prompts this rank's replica samples
    replica: list[int]  # global ranks of this rank's replica
    replica_group: object | None  # process group of the replica (engine_tp > 1)
    tp_group: object | None  # the trainer's tensor-parallel group, when it spans several replicas
    tp_src: int = 0  # global rank of that group's first member

    @classmethod
    def build(cls, engine_tp: int, dp_rank: int, tp_group=None) -> EnginePlacement:
        """Collective over the world, WORLD: colocated engines span every rank of the job (each rank calls it once,
        in the same order)."""
        if not dist.is_initialized() or dist.get_world_size(WORLD) == 1:
            return cls(engine_tp, 0, [dp_rank], [0], None, None)
        rank, world = dist.get_rank(WORLD), dist.get_world_size(WORLD)
        replica_ranks = replicas(world, engine_tp)
        dp_of = [None] * world
        dist.all_gather_object(dp_of, dp_rank, group=WORLD)
        first = {}
        for g in range(world):
            first.setdefault(dp_of[g], g)
        mine = rank // engine_tp
        dp = max(dp_of) + 1
        serves = assign_engines(dp, len(replica_ranks), [first[d] // engine_tp for d in range(dp)])[mine]
        replica_group = None
        if engine_tp > 1:
            groups = [dist.new_group(r) for r in replica_ranks]  # every rank creates every group
            replica_group = groups[mine]
        tp_ranks = list(range(world)) if tp_group is None else dist.get_process_group_ranks(tp_group)
        tp_ranks = [g for g in tp_ranks if dp_of[g] == dp_rank]
        spans = len({g // engine_tp for g in tp_ranks}) > 1
        return cls(engine_tp, rank, serves, replica_ranks[mine], replica_group, tp_group if spans else None,
                   min(tp_ranks))

    def generate(self, engine: RolloutEngine, parts: dict[int, tuple[list[list[int]], SamplingParams]],
                 n_per_prompt: int, my_dp_rank: int) -> RolloutBatch:
        """This rank's batch: the responses to data-parallel rank my_dp_rank's prompts (collective over the replica
        and the trainer's TP group). `parts` holds the prompts and sampling of every rank in `serves`."""
        batches = engine.generate_parts([parts[d] for d in self.serves], n_per_prompt) if self.serves else []
        if self.replica_group is not None:
            box = [batches]
            dist.broadcast_object_list(box, src=self.replica[0], group=self.replica_group)
            batches = box[0]
        mine = dict(zip(self.serves, batches)).get(my_dp_rank)
        if self.tp_group is not None:
            box = [mine]
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
            mine = box[0]
        if mine is None:
            raise RuntimeError(f"rank {self.rank}: no rollout for data-parallel rank {my_dp_rank} (engine placement)")
        return mine
