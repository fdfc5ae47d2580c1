"""Weights over the bridge (rollout.placement=separate): a trainer pushes each policy version to engine ranks of their
own, and an engine rank reads it as a WeightSource.

    ShardPush(roles, shard_plan(roles, mc, coords, engine_tp, needs, ...)).push(policy.weights(), version)  # trainers
    engine.update_weights(PushedShards(roles, mc, coords, version))     # engine ranks: the next version, as slices
    WeightPush(...).push(...) / PushedWeights(...): the same with whole tensors, for an engine that loads them

Whole tensors travel on the bridge's `weights` group (trainer rank 0 and the engine ranks), broadcast from trainer
rank 0 in flat buckets of the engine's dtype, in the order of the HF checkpoint's tensors; both sides derive the
bucket plan from the model config. An engine that keeps slices (its class's `takes_slices`) is pushed shard to shard
instead: every trainer rank sends each engine rank, point to point over the `data` group, the slices of its own
parameters that the engine rank keeps, in the engine's dtype and in bucket-bounded rounds (a SyncPlan,
moe_gspo.rollout.sync.plan, built on every rank from the config and the trainer coordinates of the handshake). No
trainer rank gathers the model and none relays another's weights, so a push costs each trainer rank what it holds,
not the model. Every version is led by its number, broadcast by trainer rank 0 and checked on receipt. Every wait is
bounded by rollout.bridge_timeout_s and ends in one BridgeError line (moe_gspo.rollout.bridge).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from moe_gspo.model.weights import WeightSource
from moe_gspo.rollout.bridge import Roles, bridge_errors, wait
from moe_gspo.rollout.sync.buckets import buckets


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
    from moe_gspo.rollout.sync.plan import SyncPlan

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
    engine's dtype, in rounds of at most a bucket into or out of any rank (moe_gspo.rollout.sync.plan). Nothing is
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
    addressed to this rank as they arrive (moe_gspo.rollout.vllm.sync.ShardedSync writes them)."""

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
