"""Process groups for TP x EP x DP: torchrun environment (or a single process), validation, megatron init.

    groups = init_model_parallel(ParallelConfig(tp=2, ep=2), num_experts=8, seed=0)  # torchrun --nproc-per-node 4
    info = parallel_info(groups)                                                       # this rank's place

`groups` is megatron-core's ProcessGroupCollection (tp, ep, dp, ...): built once, then handed to the policy, the
optimizer, the kernels and the trainer, which read their groups from it. Every collective here takes its group
explicitly (`trainer_group(groups)` spans the ranks that train): a job whose world also holds ranks that do not
train (rollout engines) never waits on them.

Sizes are checked before any group or model is built; every error names the field and the world size.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_gspo.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the mesh."""

    world: int
    rank: int
    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    dp: int
    dp_rank: int


def free_port() -> int:
    """A TCP port free on this host now (for a one-process group or a torchrun job launched from here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def validate_sizes(pc: ParallelConfig, world: int, num_experts: int, num_kv_heads: int | None = None,
                   vocab_size: int | None = None) -> None:
    """Raise ConfigError naming the field when TP/EP do not fit the world size or the model."""
    if world % pc.tp:
        raise ConfigError(f"parallel.tp={pc.tp} does not divide the world size {world}")
    if world % pc.ep:
        raise ConfigError(f"parallel.ep={pc.ep} does not divide the world size {world}")
    if num_experts % pc.ep:
        raise ConfigError(f"model.num_experts={num_experts} is not divisible by parallel.ep={pc.ep}")
    if num_kv_heads is not None and num_kv_heads % pc.tp:
        raise ConfigError(f"model.num_key_value_heads={num_kv_heads} is not divisible by parallel.tp={pc.tp}")
    if vocab_size is not None and vocab_size % pc.tp:
        raise ConfigError(f"model.vocab_size={vocab_size} is not divisible by parallel.tp={pc.tp}")


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors handed to collectives over `group` live: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


WORLD = None
"""torch.distributed's default group, named where a collective means every rank of this side of the job: the whole
job, or, after rollout.placement=separate has split it (moe_gspo.rollout.bridge.split_job), the trainer's ranks or
the engines' ranks. Every other collective names the group it runs over."""


def local_cuda_index() -> int:
    """The GPU this process computes on: its local rank, modulo the node's GPUs, so that ranks beyond the GPU count
    share them round-robin (a separate-placement job of a trainer and an engine rank on one GPU: their groups are
    of one rank each, so NCCL sees no GPU twice)."""
    return int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)


def trainer_group(groups) -> dist.ProcessGroup | None:
    """The group of every rank that trains, from megatron's ProcessGroupCollection: tensor x data x context
    parallel (pipeline parallelism is 1 here), so every trainer rank and no other; None for groups=None (one
    process)."""
    return None if groups is None else groups.tp_dp_cp


def _single(group: dist.ProcessGroup | None) -> bool:
    return group is None or not dist.is_initialized() or dist.get_world_size(group) == 1


def max_over_ranks(n: int, group: dist.ProcessGroup | None) -> int:
    """max of an int over the ranks of `group` (n itself for None: one process). Used to give every trainer rank
    the same padded length: megatron's token dispatcher exchanges equal-sized blocks between expert-parallel
    ranks, and those ranks belong to different data-parallel replicas, which pad their own rollouts."""
    if _single(group):
        return int(n)
    t = torch.tensor([int(n)], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def max_over_ranks_each(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise max of equal-length int lists over the ranks of `group` (the list itself for None)."""
    if _single(group) or not values:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def init_distributed(backend: str = "auto", timeout_min: int = 10) -> None:
    """Join the torchrun job (RANK/WORLD_SIZE/MASTER_* set) or start a one-process group. Idempotent.

    Restartable: after a worker dies, `torchrun --max-restarts` restarts every worker against the same TCP store,
    where gloo would find the dead attempt's addresses under the keys megatron's `new_group` calls use
    ("connectFullMesh ... Connection refused"). Prefixing the store with the restart count gives each attempt
    fresh keys."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(minutes=timeout_min)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(local_cuda_index())
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent_store and rank == 0, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"moe_gspo/attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timeout)


def init_model_parallel(pc: ParallelConfig, num_experts: int, seed: int = 0, num_kv_heads: int | None = None,
                        vocab_size: int | None = None):
    """Initialize torch.distributed, megatron's model-parallel groups (re-initialized if sizes changed) and
    megatron's per-rank RNG tracker; returns the groups as megatron's ProcessGroupCollection."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import random as mrandom

    from moe_gspo.parallel import cpu_compat

    cpu_compat.apply()
    # an initialized default group is the trainer's world (a job that splits its ranks into roles initializes it
    # on the trainer ranks alone); before that, torchrun's
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    validate_sizes(pc, world, num_experts, num_kv_heads, vocab_size)
    init_distributed(pc.backend)
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() != pc.tp
                or ps.get_expert_model_parallel_world_size() != pc.ep):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=pc.tp, expert_model_parallel_size=pc.ep,
                                     expert_tensor_parallel_size=1)
    mrandom.model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def parallel_info(groups) -> ParallelInfo:
    """This rank's place in the mesh of `groups` (a ProcessGroupCollection); world and rank count the trainer's
    ranks (trainer_group)."""
    everyone = trainer_group(groups)
    return ParallelInfo(
        world=everyone.size(), rank=everyone.rank(),
        tp=groups.tp.size(), tp_rank=groups.tp.rank(), ep=groups.ep.size(), ep_rank=groups.ep.rank(),
        dp=groups.dp.size(), dp_rank=groups.dp.rank(),
    )
