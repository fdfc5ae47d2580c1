"""Trainer ranks and engine ranks in one torchrun job (rollout.placement=separate): the split of the job, and what
moves between the two sides.

    roles = split_job(cfg.rollout)                  # before anything else touches torch.distributed
    # trainer ranks: the default group is the trainer's world (megatron's groups live inside it)
    # engine ranks: the default group is the engines' world (what vLLM's external_launcher would use)
    ShardPush(roles, shard_plan(roles, mc, coords, engine_tp, ...)).push(policy.weights(), version)  # trainer ranks
    engine.update_weights(PushedShards(roles, mc, coords, version))     # engine ranks: the next version, as slices
    WeightPush / PushedWeights: the same with whole tensors, for an engine that loads whole tensors
    BatchLink(roles).send(msg, trainer_rank, step) / .recv(engine_rank, step)

The job's last `rollout.engine_ranks` ranks host engines; the others train. Every rank opens a client of the job's
TCP store (torchrun's) and initializes torch.distributed on a prefix of it holding its own side only, so that no
trainer collective can wait on an engine rank, and the reverse. Two gloo groups span the sides:
- `data`: every rank of the job; carries the start-up handshake and the sampled batches (engine -> trainer,
  point to point, sent without waiting so that the engine goes on generating);
- `weights`: trainer rank 0 and the engine ranks; carries the number of each new policy version (checked on
  receipt), and for an engine that loads whole tensors the version itself, broadcast from trainer rank 0 in flat
  buckets of the engine's dtype, in the order of the HF checkpoint's tensors (both sides derive the bucket plan
  from the model config).
An engine that keeps slices (vLLM, at any rollout.engine_tp) is pushed shard to shard instead: every trainer rank
sends each engine rank, point to point over the data group, the slices of its own parameters that the engine rank
keeps, in the engine's dtype and in bucket-bounded rounds (moe_gspo.rollout.shard_sync.SyncPlan, built on every
rank from the config and the trainer coordinates of the handshake). No trainer rank gathers the model and none
relays another's weights, so a push costs each trainer rank what it holds, not the model.
Every operation on them waits at most rollout.bridge_timeout_s; a peer that dies or stalls ends the job with one
line naming this rank, the peer, what was waited for, what happened (the peer's connection closed, or no answer
within the timeout) and after how many seconds (BridgeError).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_gspo.config import ConfigError, UserError
from moe_gspo.model.weights import WeightSource
from moe_gspo.parallel.state import local_cuda_index
from moe_gspo.rollout.weight_sync import buckets


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


# ------------------------------------------------------------------------------------------------- weights
def bucket_plan(shapes: dict[str, tuple[int, ...]], bucket_bytes: int, itemsize: int) -> list[list[str]]:
    """Consecutive HF keys in buckets of at most bucket_bytes (a larger tensor alone in its own)."""
    return list(buckets(shapes, lambda key: {None: itemsize * math.prod(shapes[key])}, bucket_bytes))


def push_plan(mc, dtype: torch.dtype, bucket_bytes: int) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """(HF key -> shape, buckets of keys) of a push: what both sides derive from the model config."""
    from moe_gspo.model.hf_shards import hf_shapes

    shapes = hf_shapes(mc)
    return shapes, bucket_plan(shapes, bucket_bytes, torch.empty((), dtype=dtype).element_size())


class WeightPush:
    """Trainer side: every trainer rank reads the policy's HF-named state (a TP/EP policy gathers on reading, a
    collective of the trainer's groups); trainer rank 0 broadcasts it to the engine ranks bucket by bucket."""

    def __init__(self, roles: Roles, mc, dtype: torch.dtype, bucket_bytes: int):
        self.roles, self.dtype = roles, dtype
        self.shapes, self.plan = push_plan(mc, dtype, bucket_bytes)
        self.seconds = 0.0  # the last push, waiting included
        self.wait_s = 0.0  # the part of it spent waiting for the engine ranks to take it (they were generating)
        self.bytes = 0

    def push(self, weights, version: int) -> None:
        """Send `weights` (a WeightSource, read whole on every trainer rank) as policy version `version`."""
        t0 = time.perf_counter()
        root = self.roles.weights is not None
        self.wait_s = _send_version(self.roles, version)
        state = weights.whole()
        sent = 0
        for keys in self.plan:
            parts = []
            for k in keys:
                t = state[k]
                if tuple(t.shape) != tuple(self.shapes[k]):
                    raise ValueError(f"{k}: exported shape {tuple(t.shape)} != {self.shapes[k]}")
                parts.append(t.detach().reshape(-1).to("cpu", self.dtype))
            if root:
                flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                wait(lambda: self.roles.weights.broadcast(flat, 0), f"the push of policy version {version}",
                     "the engine ranks", self.roles)
                sent += flat.numel() * flat.element_size()
        self.seconds, self.bytes = time.perf_counter() - t0, sent


class ReceivedState(Mapping):
    """Engine side: one pushed policy version as an HF-named state, received bucket by bucket as its keys are read
    (once each, in order: what the engines' weight loaders do)."""

    def __init__(self, roles: Roles, shapes: dict[str, tuple[int, ...]], plan: list[list[str]], dtype):
        self.roles, self.shapes, self.plan, self.dtype = roles, shapes, plan, dtype
        self._next = 0
        self._views: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._views:
            if self._next >= len(self.plan) or key != self.plan[self._next][0]:
                raise KeyError(f"{key}: a pushed state is read once, in the order of its buckets")
            keys = self.plan[self._next]
            self._next += 1
            sizes = [math.prod(self.shapes[k]) for k in keys]
            flat = torch.empty(sum(sizes), dtype=self.dtype)
            wait(lambda: self.roles.weights.broadcast(flat, 0), "a policy version", "trainer rank 0", self.roles)
            self._views = dict(zip(keys, (p.view(self.shapes[k]) for p, k in
                                          zip(flat.split(sizes), keys))))
        return self._views.pop(key)


class PushedWeights(WeightSource):
    """What an engine on an engine rank builds from and updates from (a WeightSource of whole tensors): the policy's
    config and, at each whole(), the next version pushed by trainer rank 0 (checked against the version expected).
    Whole tensors arrive on every engine rank; a tensor-parallel engine keeps its regions of them."""

    def __init__(self, roles: Roles, mc, dtype: torch.dtype, bucket_bytes: int, version: int):
        from moe_gspo.model.hf_io import hf_config_dict

        self.roles, self.model_config, self.dtype = roles, mc, dtype
        self.config = hf_config_dict(mc)
        self.shapes, self.plan = push_plan(mc, dtype, bucket_bytes)
        self.version = version  # the version the next whole() receives
        self.last_wait_s = 0.0  # how long the last whole() waited for trainer rank 0 to begin the push

    def whole(self) -> Mapping[str, torch.Tensor]:
        _take_version(self)
        return ReceivedState(self.roles, self.shapes, self.plan, self.dtype)


def _take_version(source) -> None:
    """Engine side: wait for the header of the next push (its version, broadcast by trainer rank 0 over the weights
    group) and check it against the version `source` expects next."""
    t0 = time.perf_counter()
    got = torch.zeros(1, dtype=torch.int64)
    wait(lambda: source.roles.weights.broadcast(got, 0), f"policy version {source.version}", "trainer rank 0",
         source.roles)
    source.last_wait_s = time.perf_counter() - t0
    if int(got) != source.version:
        raise RuntimeError(f"engine rank {source.roles.rank}: received policy version {int(got)}, expected "
                           f"{source.version} (the push schedules of trainer and engine disagree)")
    source.version += 1


def _send_version(roles: Roles, version: int) -> float:
    """Trainer side: the header of a push, from trainer rank 0 (other trainer ranks send none). Returns the seconds
    spent waiting for the engine ranks to take it (they were generating)."""
    t0 = time.perf_counter()
    if roles.weights is not None:
        wait(lambda: roles.weights.broadcast(torch.tensor([version], dtype=torch.int64), 0),
             f"the push of policy version {version}", "the engine ranks", roles)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- shard to shard
PIECE_TAG = 1 << 30  # the pieces' tags on the data group, clear of the batches' (2 * step, 2 * step + 1)


@dataclass(frozen=True)
class TrainerCoords:
    """The trainer's layout as the engine ranks learn it at the handshake: its TP and EP sizes and each trainer
    rank's (tp_rank, ep_rank), by job rank."""

    tp: int
    ep: int
    ranks: list[tuple[int, int]]


def shard_plan(roles: Roles, mc, trainer: TrainerCoords, engine_tp: int, needs, bucket_bytes: int,
               dtype: torch.dtype):
    """The SyncPlan of a shard-to-shard push: the same on every rank of the job (both sides derive it from the
    config and the handshake). Engine replicas are consecutive engine ranks, engine_tp each; `needs(j)` is what
    engine rank j of a replica keeps (the engine class's `slices`)."""
    from moe_gspo.model.hf_shards import TrainerShards
    from moe_gspo.rollout.shard_sync import SyncPlan

    coords = [*trainer.ranks, *([None] * len(roles.engines))]  # engine ranks hold nothing
    groups = [roles.engines[i:i + engine_tp] for i in range(0, len(roles.engines), engine_tp)]
    return SyncPlan.build(TrainerShards(mc, trainer.tp, trainer.ep), coords, groups, needs, bucket_bytes, dtype,
                          roles.rank)


class _Posted:
    """A piece's send or receive on the bridge; waiting on it ends in a BridgeError naming the peer."""

    def __init__(self, post, what: str, peer: str, roles: Roles):
        self.what, self.peer, self.roles = what, peer, roles
        with bridge_errors(what, peer, roles):
            self.work = post()

    def wait(self) -> None:
        with bridge_errors(self.what, self.peer, self.roles):
            self.work.wait()


def _post_on_bridge(roles: Roles, what: str):
    """SyncPlan.run's `post`: a round's point-to-point ops on the data group, each round with its own tag."""
    def post(ops, i: int) -> list[_Posted]:
        out = []
        for send, buf, peer in ops:
            if send:
                out.append(_Posted(lambda: roles.data.send([buf], peer, PIECE_TAG + i), what, f"engine rank {peer}",
                                   roles))
            else:
                out.append(_Posted(lambda: roles.data.recv([buf], peer, PIECE_TAG + i), what,
                                   f"trainer rank {peer}", roles))
        return out
    return post


class ShardPush:
    """Trainer side of a shard-to-shard push (an engine that keeps slices: vLLM's, rollout.engine_tp >= 1): every
    trainer rank sends each engine rank the slices of its own parameters that the engine rank keeps, cast to the
    engine's dtype, in rounds of at most a bucket into or out of any rank (moe_gspo.rollout.shard_sync). Nothing is
    gathered on the trainer side and no rank relays another's weights; trainer rank 0 leads each version with its
    number (the header the engine ranks check)."""

    def __init__(self, roles: Roles, plan):
        self.roles, self.plan = roles, plan
        self.seconds = 0.0  # the last push, waiting included
        self.wait_s = 0.0  # the part of it spent waiting for the engine ranks to take it (they were generating)
        self.bytes = plan.sent_bytes(roles.rank)  # what this rank sends per push

    def push(self, weights, version: int) -> None:
        """Send this rank's part of `weights` (a policy's WeightSource: its `shards`) as policy version `version`."""
        t0 = time.perf_counter()
        self.wait_s = _send_version(self.roles, version)
        for _ in self.plan.run(weights.shards.local(), None,
                               post=_post_on_bridge(self.roles, f"the push of policy version {version}")):
            pass  # a trainer rank receives nothing
        self.seconds = time.perf_counter() - t0


class PushedShards(WeightSource):
    """Engine side of a shard-to-shard push: a WeightSource of slices. `plan(...)` is the push's SyncPlan for this
    engine's layout; `pieces(plan)` waits for the next version's header, checks its number and yields the pieces
    addressed to this rank as they arrive (moe_gspo.rollout.vllm_tp.ShardedSync writes them)."""

    sliced = True

    def __init__(self, roles: Roles, mc, trainer: TrainerCoords, version: int):
        from moe_gspo.model.hf_io import hf_config_dict

        self.roles, self.model_config, self.trainer = roles, mc, trainer
        self.config = hf_config_dict(mc)
        self.version = version  # the version the next pieces() receives
        self.last_wait_s = 0.0  # how long the last pieces() waited for trainer rank 0 to begin the push

    def plan(self, engine_tp: int, needs, bucket_bytes: int, dtype: torch.dtype):
        """The push's SyncPlan for an engine whose rank j keeps needs(j)."""
        return shard_plan(self.roles, self.model_config, self.trainer, engine_tp, needs, bucket_bytes, dtype)

    def pieces(self, plan) -> Iterator:
        _take_version(self)
        return plan.run({}, None, post=_post_on_bridge(self.roles, f"policy version {self.version - 1}"))

    def whole(self) -> Mapping[str, torch.Tensor]:
        raise RuntimeError("a shard-to-shard push carries each engine rank's slices only, not whole tensors")
