"""A tensor-parallel vLLM engine inside the trainer's torchrun world: its shared memory, and its weight sync.

    with run_scoped_shm(tp):                 # while the engine is built: shared-memory names unique to this job
        llm = LLM(..., tensor_parallel_size=tp, distributed_executor_backend="external_launcher")
    sync = ShardedSync(weights, model, tp, dtype, on_cpu, bucket_bytes)   # weights: policy.weights()
    sync.load(weights)                       # collective: each engine rank receives the slices it keeps

Shared memory. vLLM's CPU communicator gives each tensor-parallel group shared-memory segments named from
VLLM_DIST_IDENT (which, under external_launcher, its worker sets from the init method 'env://', leaving it empty)
and the group's ranks, e.g. /dev/shm/-tp:0-[0-1]-cpushm_0. A job that dies leaves them behind and the next job on the
same ranks then fails to start ("create shm in SHMManager failed. errno: 17"); two jobs on one machine would share
them. So while the engine is built the names get a prefix unique to the job, `moe_gspo-<pid of rank 0>-<start
time>`, and before that the segments of jobs whose rank-0 process no longer runs are removed.

Sync. The trainer's parameters stay where they are: each rank's part of every HF tensor is a view of its megatron
parameters (the weight source's `shards`, moe_gspo.model.weights), the engine's layout says which region of each
tensor each engine rank keeps (moe_gspo.rollout.vllm_shards), and a SyncPlan built once moves the pieces
(moe_gspo.rollout.shard_sync).
"""

from __future__ import annotations

import math
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.parallel.state import WORLD
from moe_gspo.rollout.shard_sync import slice_source

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "moe_gspo-"
_OWNED = re.compile(r"^moe_gspo-(\d+)-")
DEFAULT_BUCKET_BYTES = 64 * 2**20


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_shm(root: Path = SHM_DIR) -> list[str]:
    """Remove the shared-memory segments of this project's engines whose job (its rank-0 pid) has ended; returns
    their names."""
    gone = []
    if not root.is_dir():
        return gone
    for f in root.iterdir():
        m = _OWNED.match(f.name)
        if m and not _alive(int(m[1])):
            try:
                f.unlink()
                gone.append(f.name)
            except FileNotFoundError:  # another rank of this node removed it first
                pass
    return gone


def job_shm_ident() -> str:
    """One name prefix for this torchrun job's engine segments, the same on every rank (a broadcast from rank 0
    over WORLD: the ranks whose engines start together)."""
    ident = [f"{SHM_PREFIX}{os.getpid()}-{time.time_ns() % 10**12}"]
    if dist.is_initialized() and dist.get_world_size(WORLD) > 1:
        dist.broadcast_object_list(ident, src=0, group=WORLD)
    return ident[0]


@contextmanager
def run_scoped_shm(tp: int):
    """While an engine of `tp` > 1 ranks is built on the CPU: stale segments removed, and vLLM's segment names
    prefixed with this job's identifier (vLLM's own name follows it, less the slashes of its 'env://' identifier)."""
    if tp <= 1 or torch.cuda.is_available():
        yield
        return
    from vllm.distributed.device_communicators import cpu_communicator

    remove_stale_shm()
    ident = job_shm_ident()
    shm = cpu_communicator._CPUSHMDistributed
    original = shm.__dict__["make_group_name"]

    def make_group_name(communicator) -> str:
        return ident + original.__func__(communicator).lstrip("/")

    shm.make_group_name = staticmethod(make_group_name)
    try:
        yield
    finally:
        shm.make_group_name = original


class ShardedSync:
    """The weight sync of one engine rank (see the module docstring), from any source that gives slices
    (moe_gspo.rollout.shard_sync.slice_source): a policy on the same ranks (colocated, the plan over the job's
    ranks) or a shard-to-shard push to engine ranks of their own (the plan over the bridge)."""

    def __init__(self, weights, model, tp: int, dtype: torch.dtype, on_cpu: bool, bucket_bytes: int = 0,
                 expert_parallel: bool = False):
        from moe_gspo.rollout.vllm_shards import ShardWriter, engine_needs

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
