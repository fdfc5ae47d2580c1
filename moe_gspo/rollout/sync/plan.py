"""Shard-to-shard weight sync: every engine rank receives exactly the slices of the HF tensors it keeps.

    plan = SyncPlan.build(trainer, rank_coords, engine_groups, needs_of, bucket_bytes, dtype, rank)
    for piece, tensor in plan.run(views):      # collective: every rank of the world calls it, in step
        writer.write(piece, tensor)            # only the pieces addressed to this rank come out

The trainer holds each HF tensor in its TP x EP layout (moe_gspo.model.hf_shards.TrainerShards); an engine rank
keeps a region of each (its own tensor-parallel layout, given by `needs_of(engine_tp_rank)`). The plan, computed
identically on every rank from the layouts alone, cuts each engine rank's regions into pieces that one trainer rank
holds whole and picks that rank as the source: the engine rank itself when it holds the piece (a local copy),
else a holder in the same engine replica, else the holder with the fewest bytes to send so far. Pieces go in
rounds: each round moves at most `bucket_bytes` into and out of any one rank, one flat buffer per (source,
destination) pair, cast to the engine's dtype at the source, sent with non-blocking point-to-point operations all
posted at once (gloo on the CPU, NCCL on a GPU). So no rank gathers a tensor it does not keep, and what a rank
holds beyond its own weights during the sync is one round's buffers.

The ranks need not all train: a rank whose coordinates are None holds nothing and only receives (an engine rank
of its own, rollout.placement=separate), and `run` then moves the pieces over another group than the default one
(a `post` function: the bridge's group between trainer and engine ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_gspo.model.hf_shards import Region, TrainerShards
from moe_gspo.parallel.state import WORLD
from moe_gspo.rollout.base import replicas
from moe_gspo.rollout.sync.buckets import buckets, cast_into


@dataclass(frozen=True)
class Piece:
    """Region `region` of HF tensor `key`, sent from global rank `src` to global rank `dst`, which keeps `need`
    (the region the piece is part of) of that tensor."""

    key: str
    src: int
    dst: int
    region: Region
    need: Region
    shape: tuple[int, ...]  # of the piece

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _cut(region: Region, shape: tuple[int, ...]) -> tuple[int, ...]:
    if region.dim is None:
        return tuple(shape)
    out = list(shape)
    out[region.dim] = region.length
    return tuple(out)


def _intersect(need: Region, held: Region) -> Region | None:
    """The part of `need` inside `held` (a trainer shard on one dim); None if they do not overlap."""
    if held.dim is None:
        return need
    if need.dim is None:
        return held
    if need.dim != held.dim:
        raise NotImplementedError(f"an engine region on dim {need.dim} of a tensor the trainer splits on dim "
                                  f"{held.dim}")
    a, b = max(need.start, held.start), min(need.stop, held.stop)
    return Region(need.dim, a, b) if a < b else None


def take(tensor: torch.Tensor, region: Region, within: Region) -> torch.Tensor:
    """`region` of an HF tensor out of `tensor`, which is the part `within` of that tensor (a view)."""
    if region.dim is None:
        return tensor
    offset = region.start - (within.start if within.dim == region.dim else 0)
    return tensor.narrow(region.dim, offset, region.length)


@dataclass
class SyncPlan:
    pieces: list[Piece]
    rounds: list[list[Piece]]
    rank: int
    dtype: torch.dtype
    coords: list[tuple[int, int]]
    trainer: TrainerShards
    # flat send and receive buffers by (is_send, peer), kept from round to round and sync to sync: a fresh buffer
    # of a bucket's size pays its page faults on every fill (the CPU), as much as the copy into it
    buffers: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, trainer: TrainerShards, coords: list[tuple[int, int]], engine_groups: list[list[int]],
              needs_of: Callable[[int], list[tuple[str, Region]]], bucket_bytes: int, dtype: torch.dtype,
              rank: int) -> SyncPlan:
        """coords[g]: (tp_rank, ep_rank) of global rank g in the trainer, None for a rank that holds nothing;
        engine_groups: the global ranks of each engine replica, in engine-TP-rank order; needs_of(j): (HF key,
        region) an engine rank of TP rank j keeps, in HF key order."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        elem = torch.empty((), dtype=dtype).element_size()
        replica = {g: grp for grp in engine_groups for g in grp}
        sent = [0] * len(coords)
        by_key: dict[str, list[Piece]] = {}
        needs = {j: needs_of(j) for j in range(len(engine_groups[0]))}
        for grp in engine_groups:
            for j, dst in enumerate(grp):
                for key, need in needs[j]:
                    for held, ranks in _holdings(trainer, coords, key):
                        part = _intersect(need, held)
                        if part is None:
                            continue
                        if dst in ranks:
                            src = dst
                        else:
                            near = [r for r in ranks if r in replica[dst]]
                            src = min(near or ranks, key=lambda r: (sent[r], r))
                        p = Piece(key, src, dst, part, need, _cut(part, trainer.shapes[key]))
                        if src != dst:
                            sent[src] += p.numel * elem
                        by_key.setdefault(key, []).append(p)
        pieces = [p for key in trainer.keys for p in by_key.get(key, [])]
        return cls(pieces, _rounds(pieces, bucket_bytes, elem, len(coords)), rank, dtype, coords, trainer)

    def sent_bytes(self, rank: int | None = None) -> int:
        """Bytes that leave `rank` (default: this one) for other ranks over one sync."""
        r = self.rank if rank is None else rank
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(p.numel for p in self.pieces if p.src == r and p.dst != r) * elem

    def received_bytes(self, rank: int | None = None) -> int:
        """Bytes that arrive at `rank` (default: this one) from other ranks over one sync."""
        r = self.rank if rank is None else rank
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(p.numel for p in self.pieces if p.dst == r and p.src != r) * elem

    def run(self, views: dict[str, torch.Tensor], device: torch.device | None = None, post: Callable | None = None
            ) -> Iterator[tuple[Piece, torch.Tensor]]:
        """Move every piece (a collective over the world: every rank runs every round). `views`: HF key -> this
        rank's part of it (TrainerShards.local_views; empty on a rank that holds nothing). Yields (piece, tensor in
        the engine's dtype) for each piece addressed to this rank, a round at a time. `post(ops, round)` sends and
        receives a round's ops ([(is_send, buffer, peer)]) on another group than the default one and returns what
        to wait on. A yielded tensor may be a view of a buffer the next round refills: use it before resuming."""
        me = self.rank
        held = {}
        for i, rnd in enumerate(self.rounds):
            ops, recvs = [], []
            out: dict[int, list[Piece]] = {}
            inc: dict[int, list[Piece]] = {}
            local: list[Piece] = []
            for p in rnd:
                if p.src == me and p.dst == me:
                    local.append(p)
                elif p.src == me:
                    out.setdefault(p.dst, []).append(p)
                elif p.dst == me:
                    inc.setdefault(p.src, []).append(p)
            for dst, ps in out.items():  # packed and cast to the engine's dtype in one pass per piece
                buf = self._buffer(True, dst, sum(p.numel for p in ps), None)
                for p, flat in zip(ps, buf.split([q.numel for q in ps])):
                    cast_into(flat.view(p.shape), self._slice(views, p, held))
                ops.append((True, buf.to(device) if device is not None else buf, dst))
            for src, ps in inc.items():
                buf = self._buffer(False, src, sum(p.numel for p in ps), device)
                ops.append((False, buf, src))
                recvs.append((ps, buf))
            if not ops:
                works = []
            elif post is not None:
                works = post(ops, i)
            else:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, buf, peer)
                                                for send, buf, peer in ops])
            for p in local:  # a view of the trainer's own tensor: the writer's copy casts it
                yield p, self._slice(views, p, held)
            for w in works:
                w.wait()
            for ps, buf in recvs:
                for p, flat in zip(ps, buf.split([q.numel for q in ps])):
                    yield p, flat.view(p.shape)

    def _buffer(self, send: bool, peer: int, numel: int, device) -> torch.Tensor:
        buf = self.buffers.get((send, peer))
        if buf is None or buf.numel() < numel or buf.device != torch.device(device or "cpu"):
            buf = self.buffers[send, peer] = torch.empty(numel, dtype=self.dtype, device=device)
        return buf[:numel]

    def _slice(self, views, p: Piece, held: dict) -> torch.Tensor:
        tp_rank, ep_rank = self.coords[self.rank]
        within = held.get(p.key)
        if within is None:
            within = held[p.key] = self.trainer.region(p.key, tp_rank, ep_rank)
        return take(views[p.key], p.region, within)


def _holdings(trainer: TrainerShards, coords, key: str) -> list[tuple[Region, list[int]]]:
    """The distinct regions of `key` the trainer ranks hold, each with the global ranks holding it."""
    out: dict[Region, list[int]] = {}
    for g, c in enumerate(coords):
        if c is None:  # a rank that only receives
            continue
        r = trainer.region(key, *c)
        if r is not None:
            out.setdefault(r, []).append(g)
    return list(out.items())


def _rounds(pieces: list[Piece], bucket_bytes: int, elem: int, world: int) -> list[list[Piece]]:
    """Consecutive pieces grouped so that no rank sends or receives more than bucket_bytes in one round (a piece
    larger than that is a round by itself; a piece a rank keeps for itself moves nothing)."""
    def load(p: Piece) -> dict:
        b = p.numel * elem if p.src != p.dst else 0
        return {("into", p.dst): b, ("out of", p.src): b}

    return list(buckets(pieces, load, bucket_bytes))


class LocalShards:
    """The slices an engine rank keeps, from a policy whose shards live on this job's own ranks (colocated: every
    rank holds its trainer shards and runs an engine rank). The same two calls as a push from trainer ranks of
    their own (moe_gspo.rollout.sync.push.PushedShards): `plan` once, `pieces` at every sync."""

    def __init__(self, weights, device: torch.device | None):
        self.weights, self.device = weights, device

    def plan(self, engine_tp: int, needs: Callable[[int], list], bucket_bytes: int, dtype: torch.dtype) -> SyncPlan:
        """Collective over WORLD (every rank is an engine rank here): the ranks' trainer coordinates are gathered
        and the engines are consecutive groups of engine_tp ranks."""
        here = self.weights.shards
        rank, world = dist.get_rank(WORLD), dist.get_world_size(WORLD)
        coords = [None] * world
        dist.all_gather_object(coords, (here.tp_rank, here.ep_rank), group=WORLD)
        return SyncPlan.build(here.layout, coords, replicas(world, engine_tp), needs, bucket_bytes, dtype, rank)

    def pieces(self, plan: SyncPlan) -> Iterator:
        return plan.run(self.weights.shards.local(), self.device)


def slice_source(weights, device: torch.device | None = None):
    """What gives an engine rank its slices of `weights` (a WeightSource), with `plan` and `pieces`: a push to
    engine ranks of their own is one already (`sliced`); a policy on these ranks is read through LocalShards;
    a source of whole tensors only gives None."""
    if weights.sliced:
        return weights
    return LocalShards(weights, device) if weights.shards is not None else None
