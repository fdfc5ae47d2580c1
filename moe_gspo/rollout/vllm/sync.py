"""The weight sync of one vLLM engine rank: what the engine calls after every optimizer step.

    sync = vllm_sync(weights, model, tp, dtype, on_cuda, model_type, bucket_bytes, expert_parallel)
    n = sync.load(weights)                   # pieces written; sync.phases, sync.received_bytes(), sync.param_fraction

Which sync a rank gets depends on what it keeps and on what the source can give, never on the engine:
- `WholeSync`, for an engine of one rank fed whole tensors (a policy of any layout: its source gathers one tensor at
  a time; a whole-tensor push; a transformers model): the source's tensors are read once, key by key, into vLLM's
  own `load_weights` on a GPU, or moe_gspo.rollout.vllm.cpu_writer.load_weights_cpu on the CPU;
- `ShardedSync`, for an engine over several ranks, or any engine fed by a shard-to-shard push: the source gives this
  rank the slices vLLM's layout keeps here (moe_gspo.rollout.vllm.writer.engine_needs) through a SyncPlan built
  once (moe_gspo.rollout.sync.plan.slice_source), and the ShardWriter puts each piece in place. The trainer's
  parameters stay where they are: no rank gathers the model.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from moe_gspo.parallel.state import WORLD
from moe_gspo.rollout.sync.plan import slice_source
from moe_gspo.rollout.vllm.writer import ShardWriter, engine_needs
from moe_gspo.rollout.vllm.mla import refresh_latent_attention

DEFAULT_BUCKET_BYTES = 64 * 2**20


def vllm_sync(weights, model, tp: int, dtype: torch.dtype, on_cuda: bool, model_type: str, bucket_bytes: int = 0,
              expert_parallel: bool = False):
    """The sync for an engine rank holding vLLM `model` (see the module docstring), built from the first source."""
    if tp > 1 or weights.sliced:
        return ShardedSync(weights, model, tp, dtype, not on_cuda, bucket_bytes, expert_parallel)
    return WholeSync(weights, model, on_cuda, model_type)


class WholeSync:
    """Whole tensors into an engine of one rank, from any source of the architecture it was built for."""

    param_fraction = 1.0

    def __init__(self, weights, model, on_cuda: bool, model_type: str):
        self.model, self.on_cuda, self.model_type = model, on_cuda, model_type
        self.config = dict(weights.config)
        self.phases: dict[str, float] = {}

    def received_bytes(self) -> int:
        return 0  # not counted: the source is read in this process (a push counts its own)

    @torch.no_grad()
    def load(self, weights) -> int:
        if dict(weights.config) != self.config:
            changed = sorted(k for k in set(weights.config) | set(self.config)
                             if weights.config.get(k) != self.config.get(k))
            raise ValueError(f"the policy's architecture differs from the engine's ({changed[:6]}): build a new engine")
        state = weights.whole()
        if not self.on_cuda:
            from moe_gspo.rollout.vllm.cpu_writer import load_weights_cpu

            return load_weights_cpu(self.model, state, self.model_type)
        from moe_gspo.model.hf_io import file_items

        n = 0

        def counted():  # under the names the family's checkpoint files use, which vLLM's loader maps
            nonlocal n
            for name, tensor in file_items(state, self.model_type):
                n += 1
                yield name, tensor

        self.model.load_weights(counted())
        refresh_latent_attention(self.model)
        return n


class ShardedSync:
    """The slices this engine rank keeps, from any source that gives slices (moe_gspo.rollout.sync.plan.slice_source):
    a policy on the same ranks (colocated, the plan over the job's ranks) or a shard-to-shard push to engine ranks of
    their own (the plan over the bridge)."""

    def __init__(self, weights, model, tp: int, dtype: torch.dtype, on_cpu: bool, bucket_bytes: int = 0,
                 expert_parallel: bool = False):
        mc = weights.model_config
        rank = dist.get_rank(WORLD)  # among the engines' ranks: vLLM's world
        self.device = None if on_cpu else torch.device("cuda", torch.cuda.current_device())
        source = slice_source(weights, self.device)
        if source is None:
            raise ValueError(f"a vLLM engine over {tp} ranks loads slices: {type(weights).__name__} gives whole "
                             "tensors only")
        self.plan = source.plan(tp, lambda j: engine_needs(mc, tp, j, expert_parallel),
                                bucket_bytes or DEFAULT_BUCKET_BYTES, dtype)
        self.trainer = self.plan.trainer
        self.writer = ShardWriter(model, mc, tp, rank % tp, on_cpu, expert_parallel)
        mine = engine_needs(mc, tp, rank % tp, expert_parallel)
        total = sum(math.prod(s) for s in self.trainer.shapes.values())
        kept = sum(math.prod(s) if r.dim is None else math.prod(s) // s[r.dim] * r.length
                   for (k, r), s in ((kr, self.trainer.shapes[kr[0]]) for kr in mine))
        self.param_fraction = kept / total
        self.phases: dict[str, float] = {}  # the last load's seconds by phase (see load)

    def received_bytes(self) -> int:
        return self.plan.received_bytes()

    @torch.no_grad()
    def load(self, weights) -> int:
        """Move the source's current weights into this rank's engine shard (collective). Returns pieces written.
        `phases` then holds its seconds: `move` (the plan's rounds: packing, sending, receiving), `write` (pieces
        into the engine's tensors, or the experts' staging on the CPU), `prepack` (CPU: the experts packed for
        vLLM's kernel) and `repack_dense` (CPU: the dense layers' packed GEMM weights rebuilt)."""
        n, t_write = 0, 0.0
        self.writer.prepack_s = 0.0
        # the source of this update (the same kind as at build), read through the plan built then; a push waits
        # for the next version's header first
        pieces = slice_source(weights, self.device).pieces(self.plan)
        t0 = time.perf_counter()
        for piece, t in pieces:
            t1 = time.perf_counter()
            self.writer.write(piece.key, piece.region, piece.need, t)
            t_write += time.perf_counter() - t1
            n += 1
        t1 = time.perf_counter()
        self.writer.finish()
        t2 = time.perf_counter()
        self.phases = {"move": t1 - t0 - t_write, "write": t_write - self.writer.prepack_s,
                       "prepack": self.writer.prepack_s, "repack_dense": t2 - t1}
        return n
