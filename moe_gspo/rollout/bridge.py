"""Trainer ranks and engine ranks in one torchrun job (rollout.placement=separate): the split of the job, the
handshake, the sampled batches, and how a failure on the bridge is reported.

    roles = split_job(cfg.rollout)                  # before anything else touches torch.distributed
    # trainer ranks: the default group is the trainer's world (megatron's groups live inside it)
    # engine ranks: the default group is the engines' world (what vLLM's external_launcher would use)
    hellos = exchange(roles, Hello(...))            # every rank's start-up facts, on every rank
    BatchLink(roles).send(msg, trainer_rank, step) / .recv(engine_rank, step)

The job's last `rollout.engine_ranks` ranks host engines; the others train. Every rank opens a client of the job's
TCP store (torchrun's) and initializes torch.distributed on a prefix of it holding its own side only, so that no
trainer collective can wait on an engine rank, and the reverse. Two gloo groups span the sides:
- `data`: every rank of the job; carries the start-up handshake, the sampled batches (engine -> trainer, point to
  point, sent without waiting so that the engine goes on generating) and the pieces of a shard-to-shard push;
- `weights`: trainer rank 0 and the engine ranks; carries the number of each new policy version and whole-tensor
  pushes. The weights themselves are moe_gspo.rollout.sync.push's.
Every operation on them waits at most rollout.bridge_timeout_s; a peer that dies or stalls ends the job with one
line naming this rank, the peer, what was waited for, what happened (the peer's connection closed, or no answer
within the timeout) and after how many seconds (BridgeError).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_gspo.config import ConfigError, UserError
from moe_gspo.parallel.state import local_cuda_index


class BridgeError(UserError):
    """An operation between trainer and engine ranks failed or timed out: a peer died, or stalled for longer than
    rollout.bridge_timeout_s."""


@dataclass
class Roles:
    """This rank's side of a job split into trainer and engine ranks."""

    rank: int  # in the job
    world: int  # the job's size
    trainers: list[int]  # job ranks that train (0 .. T-1)
    engines: list[int]  # job ranks that host engines (T .. world-1)
    data: object = field(repr=False)  # ProcessGroupGloo over the whole job
    weights: object | None = field(repr=False)  # ProcessGroupGloo of trainer rank 0 and the engine ranks
    timeout_s: float = 600.0

    @property
    def is_engine(self) -> bool:
        return self.rank >= len(self.trainers)

    @property
    def engine_index(self) -> int:
        return self.rank - len(self.trainers)

    def close(self) -> None:
        """Meet every rank of the job once more (nothing of either side is still in flight), then drop the
        bridge groups."""
        wait(self.data.barrier, "the end of the job", "every rank", self)
        self.data = self.weights = None


def split_job(rc) -> Roles:
    """Initialize torch.distributed on this rank's side of a torchrun job and open the bridge groups (every rank of
    the job calls it once, before anything else uses torch.distributed)."""
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        raise ConfigError("rollout.placement=separate needs a torchrun job (ranks for the trainer and "
                          f"rollout.engine_ranks={rc.engine_ranks} for the engines): launch with torchrun or "
                          "scripts/launch.sh")
    if dist.is_initialized():
        raise ConfigError("rollout.placement=separate splits the torchrun job itself: torch.distributed is already "
                          "initialized in this process (launch with torchrun / scripts/launch.sh)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n = rc.engine_ranks
    if n >= world:
        raise ConfigError(f"rollout.engine_ranks={n} leaves no trainer rank in a job of {world} ranks")
    timeout = datetime.timedelta(seconds=rc.bridge_timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    # a restarted attempt (torchrun --max-restarts) finds the dead attempt's keys under another prefix
    store = dist.PrefixStore(f"moe_gspo/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    trainers, engines = list(range(world - n)), list(range(world - n, world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    side, side_rank, side_size = (("engine", rank - len(trainers), n) if rank in engines
                                  else ("trainer", rank, len(trainers)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_cuda_index())
    dist.init_process_group(backend, store=dist.PrefixStore(side, store), rank=side_rank, world_size=side_size,
                            timeout=datetime.timedelta(minutes=10))
    data = dist.ProcessGroupGloo(dist.PrefixStore("bridge_data", store), rank, world, timeout)
    weights = None
    members = [0, *engines]
    if rank in members:
        weights = dist.ProcessGroupGloo(dist.PrefixStore("bridge_weights", store), members.index(rank),
                                        len(members), timeout)
    return Roles(rank, world, trainers, engines, data, weights, rc.bridge_timeout_s)


def wait(post, what: str, peer: str, roles: Roles) -> None:
    """Post one bridge operation (`post()` returns its Work) and wait for it; a dead or stalled peer becomes a
    BridgeError naming both sides, what happened (the peer's connection closed, or no answer within the timeout) and
    how long this rank waited. Posting is inside the guard: gloo refuses to post on a connection the peer closed."""
    with bridge_errors(what, peer, roles):
        post().wait()


@contextmanager
def bridge_errors(what: str, peer: str, roles: Roles):
    """gloo's RuntimeErrors inside the block become one BridgeError line (see wait)."""
    t0 = time.monotonic()
    try:
        yield
    except RuntimeError as e:
        took = time.monotonic() - t0
        text = str(e).strip()
        cause = text.splitlines()[0][:300] if text else type(e).__name__
        raise BridgeError(f"{what} with {peer}: {_what_happened(text, roles)}, after {took:.1f} s of waiting "
                          f"({cause})") from None


def _what_happened(text: str, roles: Roles) -> str:
    """gloo's failure text, said as what a user reads it for."""
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return (f"no answer within rollout.bridge_timeout_s={roles.timeout_s:g} s (the peer stalled, or its step "
                "takes longer: raise the timeout)")
    if any(w in low for w in ("closed", "reset", "aborted", "broken pipe", "terminated")):
        return "the peer's connection closed (that rank died or left)"
    return "failed"


# ------------------------------------------------------------------------------------------------- handshake
@dataclass(frozen=True)
class Hello:
    """What each rank tells every other at start-up: a trainer rank its data-parallel rank, the step the run
    starts (or resumes) at, the data-parallel size, and its tensor- and expert-parallel ranks (the engine ranks'
    weight plans read them); an engine rank knows none of these and sends the defaults (-1)."""

    dp_rank: int = -1
    start: int = -1
    dp: int = -1
    tp_rank: int = -1
    ep_rank: int = -1

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Hello:
        return cls(*(int(v) for v in t.tolist()))


def exchange(roles: Roles, mine: Hello) -> list[Hello]:
    """Every rank's Hello, by global rank, on every rank of the job (a collective over the job's `data` group)."""
    t = mine.to_tensor()
    out = [[torch.empty_like(t) for _ in range(roles.world)]]
    wait(lambda: roles.data.allgather(out, [t]), "the start-up handshake", "every rank", roles)
    return [Hello.from_tensor(x) for x in out[0]]


# ------------------------------------------------------------------------------------------------- batches
class BatchLink:
    """Sampled batches from engine ranks to trainer ranks over the data group: a length, then the bytes of
    torch.save of a dict of tensors, lists, strings and numbers, read back with torch.load(weights_only=True)."""

    def __init__(self, roles: Roles):
        self.roles = roles
        self.pending: list[tuple[object, tuple, int, int]] = []  # (work, its buffers kept, dst, step)

    def send(self, msg: dict, dst: int, step: int) -> None:
        """Post msg to job rank dst without waiting for it (its buffers are kept until release() or flush())."""
        buf = io.BytesIO()
        torch.save(msg, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for t, tag in ((size, 2 * step), (payload, 2 * step + 1)):
            with bridge_errors("a batch sent", f"trainer rank {dst}", self.roles):
                self.pending.append((self.roles.data.send([t], dst, tag), (size, payload), dst, step))

    def release(self, before: int) -> None:
        """Free the buffers of the batches of steps < before, which their trainer ranks have received (a trainer
        pushes version v only after it received batch v - 1)."""
        for work, _, dst, _ in (p for p in self.pending if p[3] < before):
            wait(lambda: work, "a batch sent", f"trainer rank {dst}", self.roles)
        self.pending = [p for p in self.pending if p[3] >= before]

    def flush(self) -> None:
        """Wait until every posted batch has been received."""
        self.release(2**62)

    def recv(self, src: int, step: int) -> dict:
        size = torch.zeros(1, dtype=torch.int64)
        wait(lambda: self.roles.data.recv([size], src, 2 * step), f"the batch of step {step}", f"engine rank {src}",
             self.roles)
        payload = torch.empty(int(size), dtype=torch.uint8)
        wait(lambda: self.roles.data.recv([payload], src, 2 * step + 1), f"the batch of step {step}",
             f"engine rank {src}", self.roles)
        return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
