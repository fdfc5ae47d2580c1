"""Training checkpoints: resharding (any TP x EP x DP layout resumes any other), atomic, verified, code-free.

    ckpts = Checkpoints(run_dir / "checkpoints", keep=2)
    ckpts.save(step, ctx, extra)        # collective: policy, optimizer (+ reference policy), schedule, RNG
    step = ckpts.latest()               # collective: newest complete, verified checkpoint, or 0
    extra = ckpts.load(step, ctx)       # collective: every rank takes its own shard of every tensor

Layout of DIR/step_00000010/:
    model.safetensors        every parameter, unsharded, under megatron's names (model dtype)
    optimizer.safetensors    "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>": the fp32 main parameters and
                             Adam moments, unsharded (gathered over TP, EP and the distributed optimizer's DP)
    reference.safetensors    the frozen KL reference policy (only with algorithm.kl_beta > 0)
    rng.safetensors          each rank's torch RNG state ("rank_00000", ...)
    state.json               step, data position, LR-schedule state, Adam step, Python/NumPy RNG, config
    manifest.json            bytes and sha256 of every file above, the layout that wrote it

Tensors are stored unsharded, so resuming at another layout is moe_gspo.model.hf_io.shard_state on load, the same
split that loads HF weights. Nothing read back is executed: tensors come from safetensors (a header and raw bytes),
the rest from JSON; no file is unpickled. A save writes DIR/.tmp-step_*/ from rank 0 (each file flushed and fsynced),
then manifest.json, renames the directory into place and fsyncs DIR. A directory without a manifest, with a file
missing, short, whose hash differs, or that does not parse as safetensors / JSON, is reported and skipped in favour
of the one before. Assumes DIR is on a file system every rank sees (one node, or a shared file system).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save

from moe_gspo.model.hf_io import fsync_dir
from moe_gspo.parallel.state import comm_device

PREFIX, TMP = "step_", ".tmp-"
FORMAT = "moe-gspo-checkpoint-v2"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_synced(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or corrupt (the message says which and why)."""


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
    def save(self, step: int, ctx, extra: dict) -> Path:
        """Collective. ctx: the StepContext (policy, optim, reference); extra: JSON-able run state."""
        from moe_gspo.parallel.state import current_info

        rank, world = _rank_world()
        policy, optim = ctx.policy, ctx.optim
        model = policy.full_megatron_state()
        opt = {f"{kind}/{k}": v for kind, d in optim.local_state().items() for k, v in policy.gather_full(d).items()}
        ref = ctx.reference.full_megatron_state() if ctx.reference is not None else None
        rng = [torch.get_rng_state()]
        if world > 1:
            dev = comm_device()
            rng = [torch.empty_like(rng[0], device=dev) for _ in range(world)]
            dist.all_gather(rng, torch.get_rng_state().to(dev))
            rng = [r.cpu() for r in rng]
        final, tmp = self.root / self.name(step), self.root / f"{TMP}{self.name(step)}"
        if rank == 0:
            info = current_info()
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            files = [_write_synced(tmp / "model.safetensors", save(_contiguous(model))),
                     _write_synced(tmp / "optimizer.safetensors", save(_contiguous(opt)))]
            if ref is not None:
                files.append(_write_synced(tmp / "reference.safetensors", save(_contiguous(ref))))
            files.append(_write_synced(tmp / "rng.safetensors",
                                       save({f"rank_{r:05d}": t for r, t in enumerate(rng)})))
            state = {**extra, "format": FORMAT, "scheduler": optim.scheduler_state(), "adam_step": optim.adam_step,
                     "rng": _rng_json()}
            files.append(_write_synced(tmp / "state.json", json.dumps(state).encode()))
            manifest = {"format": FORMAT, "step": step, "world_size": world,
                        "layout": {"tp": info.tp, "ep": info.ep, "dp": info.dp}, "files": files}
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
    def verify(self, step: int) -> dict:
        """The manifest of checkpoint `step`; raises CheckpointError naming what is wrong."""
        d = self.root / self.name(step)
        mpath = d / "manifest.json"
        if not mpath.is_file():
            raise CheckpointError(f"{d}: no manifest.json (interrupted while writing)")
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{d}: unreadable manifest.json ({e})") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{d}: format {manifest.get('format')!r}, this version reads {FORMAT!r}")
        names = {e.get("file") for e in files}
        for need in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
            if need not in names:
                raise CheckpointError(f"{d}: manifest lists no {need}")
        for e in files:
            f = d / e["file"]
            if not f.is_file():
                raise CheckpointError(f"{d}: {e['file']} is missing")
            size = f.stat().st_size
            if size != e["bytes"]:
                raise CheckpointError(f"{d}: {e['file']} has {size} bytes, manifest says {e['bytes']} (truncated?)")
            if hashlib.sha256(f.read_bytes()).hexdigest() != e["sha256"]:
                raise CheckpointError(f"{d}: {e['file']} fails its sha256 check (corrupt)")
            try:  # parse, never execute: a safetensors header is JSON, state.json is JSON
                if f.suffix == ".safetensors":
                    with safe_open(f, framework="pt") as st:
                        st.keys()
                else:
                    json.loads(f.read_text())
            except Exception as e:  # noqa: BLE001 - any parse failure means this file is not what it claims
                raise CheckpointError(f"{d}: {f.name} is not a valid {f.suffix[1:]} file ({type(e).__name__})") \
                    from None
        return manifest

    def latest(self) -> int:
        """Newest verified checkpoint step (reporting and skipping bad ones), 0 when none. Collective: rank 0
        chooses and tells the others."""
        rank, world = _rank_world()
        choice = [0]
        if rank == 0:
            for s in self.steps():
                try:
                    self.verify(s)
                    choice = [s]
                    break
                except CheckpointError as e:
                    self.log(f"warning: skipping checkpoint: {e}")
        if world > 1:
            dist.broadcast_object_list(choice, src=0)
        return int(choice[0])

    def load_weights(self, step: int, policy) -> None:
        """Only the policy's weights of checkpoint `step` (verified first), at this policy's layout: for sampling
        from a trained run without its optimizer."""
        self.verify(step)
        d = self.root / self.name(step)
        try:
            model = load_file(d / "model.safetensors")
            policy.load_full_megatron_state({k: v.to(next(policy.parameters()).dtype) for k, v in model.items()})
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{d}: weights do not load into this model ({e})") from None

    def load(self, step: int, ctx) -> dict:
        """Load checkpoint `step` into ctx (policy, optimizer, schedule, reference, RNG) at this run's layout;
        returns state.json. Collective."""
        rank, world = _rank_world()
        d = self.root / self.name(step)
        try:
            state = json.loads((d / "state.json").read_text())
            model = load_file(d / "model.safetensors")
            opt = load_file(d / "optimizer.safetensors")
            rng = load_file(d / "rng.safetensors")
            ref = load_file(d / "reference.safetensors") if ctx.reference is not None else None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{d}: cannot be read ({type(e).__name__}: {e})") from None
        if ctx.reference is not None and ref is None:
            raise CheckpointError(f"{d}: has no reference.safetensors but algorithm.kl_beta > 0")
        policy = ctx.policy
        try:
            policy.load_full_megatron_state({k: v.to(next(policy.parameters()).dtype) for k, v in model.items()})
            if ref is not None:
                ctx.reference.load_full_megatron_state(ref)
            by_kind: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in opt.items():
                kind, name = key.split("/", 1)
                by_kind.setdefault(kind, {})[name] = t
            local = {kind: policy.shard_full(full) for kind, full in by_kind.items()}
            ctx.optim.load_local_state(local, int(state["adam_step"]))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{d}: does not fit this model ({e})") from None
        ctx.optim.load_scheduler_state(state["scheduler"])
        key = f"rank_{rank:05d}" if len(rng) == world else "rank_00000"
        torch.set_rng_state(rng[key])
        _set_rng_json(state["rng"])
        return state


def _contiguous(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in d.items()}
