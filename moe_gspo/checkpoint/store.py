"""Training checkpoints: sharded (every rank writes its own shards), resharding (any TP x EP x DP layout resumes any
other), atomic, verified, code-free.

    ckpts = Checkpoints(run_dir / "checkpoints", keep=2)
    ckpts.save(step, ctx, extra)        # collective: policy, optimizer (+ reference policy), schedule, RNG
    step = ckpts.latest()               # collective: newest complete, verified checkpoint, or 0
    extra = ckpts.load(step, ctx)       # collective: every rank reads only the slices it holds

Layout of DIR/step_00000010/:
    shards/                  megatron-core dist_checkpointing (torch_dist format, moe_gspo.checkpoint.sharded_io):
      __<rank>_<i>.distcp    each rank's shards of the model weights (model dtype), the optimizer's fp32 main
                             parameters and Adam moments, and the frozen KL reference policy (kl_beta > 0)
      .metadata              torch DCP's global index (key -> global shape, dtype, chunks), read by a restricted
                             unpickler that resolves only DCP's metadata classes
      metadata.json          megatron's format name and version
    rng.safetensors          each rank's torch RNG state ("rank_00000", ...)
    state.json               step, data position, LR-schedule state, Adam step, Python/NumPy RNG, config
    manifest.json            bytes and sha256 of every file above, the layout that wrote it

Each tensor is saved as a ShardedTensor (global shape, this rank's offsets, replica id) from megatron's
`sharded_state_dict()` of the model and optimizer; on load each rank asks for the slices its own layout holds, so
resuming at another layout needs no gather. Nothing read back is executed: `.metadata` goes through the restricted
unpickler, tensor blobs through `torch.load(weights_only=True)`, the rest is JSON or safetensors. A save writes
DIR/.tmp-step_*/ (every rank its shards, each file fsynced; rank 0 the rest), then manifest.json, renames the
directory into place and fsyncs DIR. A directory without a manifest, with a file missing, short, whose hash differs,
or that does not parse as what it claims, is reported and skipped in favour of the one before (every rank checks a
share of the files). A save that runs out of space raises OutOfSpace, one line naming the directory, the free and
needed bytes and the checkpoint `--resume` continues from, and removes its partial DIR/.tmp-step_*/ (which is never
taken as complete).
Assumes DIR is on a file system every rank sees (one node, or a shared file system).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch.distributed.checkpoint.api import CheckpointException

from moe_gspo.config import UserError
from moe_gspo.model.hf_io import fsync_dir
from moe_gspo.parallel import cpu_compat
from moe_gspo.parallel.state import comm_device
from moe_gspo.checkpoint import disk_space, sharded_io, sharded_state
from moe_gspo.checkpoint.disk_space import OutOfSpace  # noqa: F401 - raised here, caught by its importers

PREFIX, TMP, SHARDS = "step_", ".tmp-", "shards"
FORMAT = "moe-gspo-checkpoint-v3"
REQUIRED = (f"{SHARDS}/.metadata", f"{SHARDS}/metadata.json", "rng.safetensors", "state.json")


# Our own collectives below run over the group a Checkpoints is given: the ranks that save and load together.
def _rank_world(group) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(group) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _gather_objects(obj, group) -> list:
    """Every rank's `obj` (small, JSON-like), on every rank of `group`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _entry(root: Path, path: Path) -> dict:
    return {"file": path.relative_to(root).as_posix(), "bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_synced(root: Path, path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.relative_to(root).as_posix(), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint directory is incomplete, corrupt or unsafe (the message says which file and why)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds content the restricted readers refuse to load (a pickle that would run code)."""


def _ran_out_of_space(e: BaseException, free: int, needed: int) -> bool:
    """Whether the failed checkpoint write `e` ran out of space. Python's own writes (torch DCP's `.metadata`,
    megatron's metadata.json, the files rank 0 writes here) raise an OSError with errno ENOSPC. torch's C++ writers
    do not: megatron's forked shard writers hand back only the text of theirs ("[enforce fail at
    inline_container.cc:...] unexpected pos ...") inside a CheckpointException, which reaches the other ranks with
    no failures at all, and torch.save to a full disk raises a bare RuntimeError ("iostream error"). Those two
    count as out of space when the file system has less free space than the checkpoint needs; anything else is a
    bug."""
    if disk_space.enospc(e) is not None:
        return True
    return (isinstance(e, CheckpointException) or type(e) is RuntimeError) and free < needed


def _rng_json() -> dict:
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _set_rng_json(rng: dict) -> None:
    v, state, gauss = rng["python"]
    random.setstate((v, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


class Checkpoints:
    """The checkpoints of one run directory. `group`: the process group of the ranks that save and load them
    together, every trainer rank (moe_gspo.parallel.state.trainer_group). None means the default group, and is
    meant for one process or a job whose every rank trains. The shard files themselves are written and read by
    megatron's dist_checkpointing over torch's default group: under rollout.placement=separate the job split makes
    that group the trainer's side of the job (moe_gspo.rollout.bridge.split_job), the same ranks as `group`."""

    def __init__(self, root: str | Path, keep: int = 2, log=None, group=None):
        self.root = Path(root)
        self.keep = keep
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.group = group

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
    def save(self, step: int, ctx, extra: dict) -> Path:
        """Collective. ctx: the StepContext (policy, optim, reference); extra: JSON-able run state. Running out of
        space raises OutOfSpace on every rank that sees it, after the partial DIR/.tmp-step_*/ is removed."""
        tmp = self.root / f"{TMP}{self.name(step)}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch DCP's deprecation notices about megatron's calls
            sharded = sharded_state.sharded_state_dict(ctx, loading=False)
        sharded_state.check_steps(ctx.optim.optimizer, ctx.optim.adam_step)
        needed = sum(_gather_objects(sharded_io.bytes_to_write(sharded), self.group))
        try:
            return self._write(step, ctx, extra, sharded)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch DCP's failures are BaseExceptions
            free = disk_space.free_bytes(tmp)
            if not _ran_out_of_space(e, free, needed):
                raise
            # rank 0 removes what got written once every rank that failed has measured the free space (the shard
            # writes are collective, so all ranks fail there together; a failure in rank 0's own files meets the
            # others at the barrier that ends a save)
            _barrier(self.group)
            if _rank_world(self.group)[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise OutOfSpace(f"writing checkpoint {tmp}: out of space (the checkpoint's tensors alone take about "
                             f"{disk_space.size(needed)}); "
                             f"{disk_space.advice(self, free, each=disk_space.newest_checkpoint_bytes(self) or needed)}"
                             ) from None

    def _write(self, step: int, ctx, extra: dict, sharded: dict) -> Path:
        """Every file of checkpoint `step` into DIR/.tmp-step_*/, then the manifest, then the rename. Collective."""
        from moe_gspo.parallel.state import parallel_info

        rank, world = _rank_world(self.group)
        final, tmp = self.root / self.name(step), self.root / f"{TMP}{self.name(step)}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / SHARDS).mkdir(parents=True)
        _barrier(self.group)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch DCP's deprecation notices about megatron's calls
            sharded_io.save_sharded(sharded, tmp / SHARDS)
        # every rank hashes a share of the shard files
        written = sorted((tmp / SHARDS).iterdir())
        mine = [_entry(tmp, p) for p in written[rank::world]]
        files = [e for part in _gather_objects(mine, self.group) for e in part]
        rng = [torch.get_rng_state()]
        if world > 1:
            dev = comm_device()
            rng = [torch.empty_like(rng[0], device=dev) for _ in range(world)]
            dist.all_gather(rng, torch.get_rng_state().to(dev), group=self.group)
            rng = [r.cpu() for r in rng]
        if rank == 0:
            info = parallel_info(ctx.policy.groups)
            files.append(_write_synced(tmp, tmp / "rng.safetensors",
                                       save({f"rank_{r:05d}": t for r, t in enumerate(rng)})))
            state = {**extra, "format": FORMAT, "scheduler": ctx.optim.scheduler_state(),
                     "adam_step": ctx.optim.adam_step, "rng": _rng_json()}
            files.append(_write_synced(tmp, tmp / "state.json", json.dumps(state).encode()))
            manifest = {"format": FORMAT, "step": step, "world_size": world,
                        "layout": {"tp": info.tp, "ep": info.ep, "dp": info.dp},
                        "reference": ctx.reference is not None, "files": files}
            _write_synced(tmp, tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
            fsync_dir(tmp / SHARDS)
            fsync_dir(tmp)
            if final.exists():  # the same step saved again after a resume
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.root)
            self._rotate()
        _barrier(self.group)
        return final

    def _rotate(self) -> None:
        for s in self.steps()[self.keep:]:
            shutil.rmtree(self.root / self.name(s), ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith(TMP):
                shutil.rmtree(p, ignore_errors=True)

    # ---------------------------------------------------------------- verify
    def manifest(self, step: int) -> dict:
        """The parsed manifest of checkpoint `step`; raises CheckpointError naming what is wrong."""
        d = self.root / self.name(step)
        mpath = d / "manifest.json"
        if not mpath.is_file():
            raise CheckpointError(f"{d}: no manifest.json (interrupted while writing)")
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
            names = {e["file"] for e in files}
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{mpath}: unreadable ({type(e).__name__}: {e})") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{mpath}: format {manifest.get('format')!r}, this version reads {FORMAT!r}")
        for need in REQUIRED:
            if need not in names:
                raise CheckpointError(f"{mpath}: lists no {need}")
        if any(Path(n).is_absolute() or ".." in Path(n).parts for n in names):
            raise CheckpointError(f"{mpath}: lists a file outside {d}")
        return manifest

    def verify(self, step: int, part: tuple[int, int] = (0, 1)) -> dict:
        """The manifest of checkpoint `step` after checking every file it lists (with part=(i, n), only every
        n-th file from the i-th: one rank's share); raises CheckpointError naming the file and what is wrong."""
        d = self.root / self.name(step)
        manifest = self.manifest(step)
        for e in manifest["files"][part[0]::part[1]]:
            f = d / e["file"]
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            size = f.stat().st_size
            if size != e["bytes"]:
                raise CheckpointError(f"{f}: {size} bytes, the manifest says {e['bytes']} (truncated?)")
            if _sha256(f) != e["sha256"]:
                raise CheckpointError(f"{f}: fails its sha256 check (corrupt)")
            try:  # parse, never execute
                if f.suffix == ".safetensors":
                    with safe_open(f, framework="pt") as st:
                        st.keys()
                elif f.suffix == ".json":
                    json.loads(f.read_text())
                elif f.name == ".metadata":
                    sharded_io.read_metadata(f)
            except sharded_io.UnsafeCheckpoint as err:
                raise CheckpointError(str(err)) from None
            except Exception as err:  # noqa: BLE001 - any parse failure: this file is not what it claims
                raise CheckpointError(f"{f}: not a valid {f.suffix[1:] or f.name} file ({type(err).__name__})") \
                    from None
        return manifest

    def latest(self, below: int | None = None) -> int:
        """Newest verified checkpoint step (reporting and skipping bad ones), 0 when none; with `below`, the newest
        before that step. Collective: every rank checks a share of each candidate's files; rank 0 reports."""
        rank, world = _rank_world(self.group)
        for s in self.steps():
            if below is not None and s >= below:
                continue
            try:
                self.verify(s, (rank, world))
                err = None
            except CheckpointError as e:
                err = str(e)
            errors = [e for e in _gather_objects(err, self.group) if e is not None]
            if not errors:
                return s
            if rank == 0:
                self.log(f"warning: skipping checkpoint {self.root / self.name(s)}: {errors[0]}")
        return 0

    # ---------------------------------------------------------------- load
    @staticmethod
    def _index(d: Path) -> dict:
        """key -> (global shape, dtype) of every tensor in checkpoint `d`, from its `.metadata` read safely. Read
        before megatron loads: torch DCP would log its own tracebacks and look for per-rank fallbacks."""
        try:
            return sharded_io.tensor_keys(d / SHARDS)
        except sharded_io.UnsafeCheckpoint as e:
            raise UnsafeCheckpointError(str(e)) from None

    def _load_shards(self, d: Path, sharded: dict) -> dict:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return sharded_io.load_sharded(sharded, d / SHARDS)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - megatron / torch DCP errors
            unsafe = sharded_io.failure_in(e)
            if unsafe is not None:
                raise UnsafeCheckpointError(str(unsafe)) from None
            failures = [exc for exc, _trace in getattr(e, "failures", {}).values()]
            raise CheckpointError(f"{d / SHARDS}: does not fit this model ({_first_line(failures[0] if failures else e)})") \
                from None

    def load_weights(self, step: int, policy) -> None:
        """Only the policy's weights of checkpoint `step` (verified first), at this policy's layout: for sampling
        from a trained run without its optimizer. Collective."""
        self.verify(step)
        d = self.root / self.name(step)
        self._index(d)
        out = self._load_shards(d, {"model": policy.gpt.sharded_state_dict()})
        _load_module(policy.gpt, out["model"], d)

    def load_newest(self, step: int, ctx) -> tuple[int, dict]:
        """Load checkpoint `step` (from `latest()`) into ctx; if it is refused for unsafe content, which only loading
        can tell (a tensor blob that is a crafted pickle), report it and load the next older verified checkpoint,
        as `latest()` does for every other damage. (step loaded, its state.json); the last refusal's
        CheckpointError when no older checkpoint is left. Collective: torch DCP hands a read's failure to every
        rank, so all ranks fall back together. Nothing is assigned to ctx before a checkpoint's tensors are read."""
        while True:
            try:
                return step, self.load(step, ctx)
            except UnsafeCheckpointError as e:
                older = self.latest(below=step)
                if not older:
                    raise
                if _rank_world(self.group)[0] == 0:
                    self.log(f"warning: skipping checkpoint {self.root / self.name(step)}: {e}")
                step = older

    def load(self, step: int, ctx) -> dict:
        """Load checkpoint `step` into ctx (policy, optimizer, schedule, reference, RNG) at this run's layout;
        returns state.json. Collective."""
        rank, world = _rank_world(self.group)
        d = self.root / self.name(step)
        manifest = self.manifest(step)
        if ctx.reference is not None and not manifest.get("reference"):
            raise CheckpointError(f"{d}: holds no KL reference policy but algorithm.kl_beta > 0")
        try:
            state = json.loads((d / "state.json").read_text())
            rng = load_file(d / "rng.safetensors")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{d}: cannot be read ({type(e).__name__}: {e})") from None
        saved = self._index(d)
        sharded = sharded_state.sharded_state_dict(ctx, loading=True)
        sharded_state.main_params_from_weights(ctx, sharded, saved)
        out = self._load_shards(d, sharded)
        _load_module(ctx.policy.gpt, out["model"], d)
        if ctx.reference is not None:
            _load_module(ctx.reference.gpt, out["reference"], d)
        sharded_state.set_steps(out["optimizer"], int(state["adam_step"]))
        try:
            with cpu_compat.cuda_type_names(), cpu_compat.torch_adam_state_load():
                ctx.optim.optimizer.load_state_dict(out["optimizer"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{d / SHARDS}: optimizer state does not fit ({_first_line(e)})") from None
        sharded_state.own_steps(ctx.optim.optimizer)  # megatron's distributed optimizer shares one step tensor
        sharded_state.check_steps(ctx.optim.optimizer, int(state["adam_step"]))
        ctx.optim.load_scheduler_state(state["scheduler"])
        key = f"rank_{rank:05d}" if len(rng) == world else "rank_00000"
        torch.set_rng_state(rng[key])
        _set_rng_json(state["rng"])
        return state


def _load_module(module, state: dict, d: Path) -> None:
    # `_extra_state` entries (Transformer Engine's FP8 metadata) are never written (sharded_io leaves
    # ShardedObjects out), and some have no entry in megatron's sharded state dict at all (TEDotProductAttention's):
    # each module keeps its own, as it does for those loaded as None
    missing = {k: None for k in module.state_dict(keep_vars=True) if k.endswith("._extra_state") and k not in state}
    try:
        module.load_state_dict({**state, **missing}, strict=True)
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{d / SHARDS}: weights do not fit this model ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    """One line of an exception: its first, or for torch's load_state_dict report ("Error(s) in loading ...:"),
    the first line of the report's body; at most 300 characters."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    line = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {line[:300]}"
