"""The shared memory of a tensor-parallel vLLM engine on the CPU, inside the trainer's torchrun world.

    with run_scoped_shm(tp):                 # while the engine is built: shared-memory names unique to this job
        llm = LLM(..., tensor_parallel_size=tp, distributed_executor_backend="external_launcher")

vLLM's CPU communicator gives each tensor-parallel group shared-memory segments named from
VLLM_DIST_IDENT (which, under external_launcher, its worker sets from the init method 'env://', leaving it empty)
and the group's ranks, e.g. /dev/shm/-tp:0-[0-1]-cpushm_0. A job that dies leaves them behind and the next job on the
same ranks then fails to start ("create shm in SHMManager failed. errno: 17"); two jobs on one machine would share
them. So while the engine is built the names get a prefix unique to the job, `moe_gspo-<pid of rank 0>-<start
time>`, and before that the segments of jobs whose rank-0 process no longer runs are removed.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.parallel.state import WORLD

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "moe_gspo-"
_OWNED = re.compile(r"^moe_gspo-(\d+)-")


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
