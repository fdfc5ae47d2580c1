"""Joining a torchrun job so that `torchrun --max-restarts` can restart it: one store namespace per attempt.

After a worker dies, torchrun restarts every worker against the same TCP store. torch 2.13's gloo then finds the
dead attempt's addresses under the keys that megatron's `new_group` calls use and fails ("connectFullMesh ...
Connection refused"). Prefixing the store with the restart count gives each attempt fresh keys. (This belongs in
moe_gspo/parallel/state.py's init_distributed; until it lands there the trainer calls this first, and
init_distributed then sees an initialized process group and leaves it alone.)
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed_restartable(backend: str = "auto", timeout_min: int = 10) -> None:
    """Under torchrun (RANK/WORLD_SIZE/MASTER_* set) init the default group on a per-attempt prefixed store."""
    if dist.is_initialized() or "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=timeout_min)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"moe_gspo/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
