"""Checkpoints that survive faults: written atomically, verified on load, the last K kept.

    ckpts = Checkpoints(run_dir / "checkpoints", keep=2)
    ckpts.save(step, state)                  # collective: every rank passes its own state dict
    step, state = ckpts.load_latest()        # collective: newest complete one, or (0, None)

Layout: DIR/step_00000010/{rank_00000.pt, ..., manifest.json}. A save writes DIR/.tmp-step_00000010/ (every rank
its file, flushed and fsynced), then rank 0 writes manifest.json (bytes and sha256 of every rank's file), fsyncs
it and renames the directory into place, then fsyncs DIR. A directory without a manifest, with a file missing,
short or whose hash differs, or that does not unpickle, is reported and skipped in favour of the one before.
Resume needs the same world size and TP x EP layout (each rank loads its own shard). Assumes DIR is on a file
system every rank sees (one node, or a shared file system across nodes).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.fsutil import fsync_dir

PREFIX, TMP = "step_", ".tmp-"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or corrupt (the message says which and why)."""


class CheckpointLayoutError(ValueError):
    """A complete checkpoint written by a different world size: resuming it needs the same layout (not skipped)."""


class Checkpoints:
    def __init__(self, root: str | Path, keep: int = 2, log=None):
        self.root = Path(root)
        self.keep = keep
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    @staticmethod
    def name(step: int) -> str:
        return f"{PREFIX}{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the directories that look like checkpoints (not verified), newest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
                out.append(int(p.name[len(PREFIX):]))
        return sorted(out, reverse=True)

    # ---------------------------------------------------------------- save
    def save(self, step: int, state: dict) -> Path:
        rank, world = _rank_world()
        final, tmp = self.root / self.name(step), self.root / f"{TMP}{self.name(step)}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        fname = f"rank_{rank:05d}.pt"
        _write_synced(tmp / fname, data)
        entry = {"file": fname, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        entries = [None] * world
        if world > 1:
            dist.all_gather_object(entries, entry)
        else:
            entries = [entry]
        if rank == 0:
            manifest = {"step": step, "world_size": world, "files": entries}
            _write_synced(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
            fsync_dir(tmp)
            if final.exists():  # the same step saved again after a resume
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.root)
            self._rotate()
        _barrier()
        return final

    def _rotate(self) -> None:
        for s in self.steps()[self.keep:]:
            shutil.rmtree(self.root / self.name(s), ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith(TMP):
                shutil.rmtree(p, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def verify(self, step: int, world: int | None = None) -> dict:
        """The manifest of checkpoint `step`; raises CheckpointError naming what is wrong."""
        d = self.root / self.name(step)
        mpath = d / "manifest.json"
        if not mpath.is_file():
            raise CheckpointError(f"{d}: no manifest.json (interrupted while writing)")
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{d}: unreadable manifest.json ({e})") from None
        if world is not None and manifest.get("world_size") != world:
            raise CheckpointLayoutError(f"{d}: written by {manifest.get('world_size')} ranks, this run has {world} "
                                  f"(resume needs the same world size and parallel layout)")
        for e in files:
            f = d / e["file"]
            if not f.is_file():
                raise CheckpointError(f"{d}: {e['file']} is missing")
            size = f.stat().st_size
            if size != e["bytes"]:
                raise CheckpointError(f"{d}: {e['file']} has {size} bytes, manifest says {e['bytes']} (truncated?)")
            if hashlib.sha256(f.read_bytes()).hexdigest() != e["sha256"]:
                raise CheckpointError(f"{d}: {e['file']} fails its sha256 check (corrupt)")
        return manifest

    def latest_valid(self, world: int | None = None) -> int | None:
        """Newest verified checkpoint step (reporting and skipping bad ones), or None."""
        for s in self.steps():
            try:
                self.verify(s, world)
                return s
            except CheckpointError as e:
                self.log(f"warning: skipping checkpoint: {e}")
        return None

    def load_latest(self) -> tuple[int, dict | None]:
        """(step, this rank's state) of the newest complete checkpoint, (0, None) when there is none.

        Rank 0 chooses, every rank loads its own file (collective)."""
        rank, world = _rank_world()
        choice: list = [None]
        if rank == 0:
            try:
                choice = [self.latest_valid(world)]
            except CheckpointLayoutError as e:
                choice = [str(e)]
        if world > 1:
            dist.broadcast_object_list(choice, src=0)
        step = choice[0]
        if isinstance(step, str):
            raise CheckpointLayoutError(step)
        if step is None:
            return 0, None
        path = self.root / self.name(step) / f"rank_{rank:05d}.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - verified bytes that do not unpickle: report which file
            raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from None
        return step, state
