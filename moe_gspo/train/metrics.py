"""Step metrics: averaging over micro-batches, minibatches and ranks; JSONL, tensorboard, Weights & Biases
(logging.wandb_project) and a progress bar.

Keys ending in `_max` / `_min` are reduced with max / min, everything else is averaged, over the ranks of the
group the trainer passes (its own ranks, never a rollout engine's). Only the trainer's rank 0 writes. Timing keys (`time/*`, `tokens_per_s`) are the only ones that differ between identical runs.
"""

from __future__ import annotations

import errno
import gzip
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from moe_gspo.config import ConfigError
from moe_gspo.parallel.state import comm_device
from moe_gspo.checkpoint.disk_space import free_bytes
from moe_gspo.train.host_reads import SYNC_WARNING, host_syncs  # noqa: F401 - SYNC_WARNING: tests read it here

TIMING_PREFIXES = ("time/", "perf/")


def _kind(key: str) -> str:
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"


class MetricMean:
    """Accumulates flat dicts of floats: mean per key (over the dicts that have it), max/min for *_max/*_min."""

    def __init__(self):
        self._v: dict[str, float] = {}
        self._n: dict[str, int] = {}

    def add(self, m: dict[str, float]) -> None:
        for k, v in m.items():
            v = float(v)
            if k not in self._v:
                self._v[k], self._n[k] = v, 1
                continue
            kind = _kind(k)
            self._v[k] = max(self._v[k], v) if kind == "max" else min(self._v[k], v) if kind == "min" else \
                self._v[k] + v
            self._n[k] += 1

    def result(self) -> dict[str, float]:
        return {k: (v / self._n[k] if _kind(k) == "mean" else v) for k, v in self._v.items()}


def reduce_across_ranks(m: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Average (or max/min) every key over the ranks of `group` that report it (a rank may lack a key, e.g. no
    mismatch); m itself for group None (one process)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(m)
    all_keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(all_keys, sorted(m), group=group)
    keys = sorted(set().union(*all_keys))
    dev = comm_device(group)
    out = {}
    for kind, op, fill in (("mean", dist.ReduceOp.SUM, 0.0), ("max", dist.ReduceOp.MAX, -math.inf),
                           ("min", dist.ReduceOp.MIN, math.inf)):
        ks = [k for k in keys if _kind(k) == kind]
        if not ks:
            continue
        t = torch.tensor([m.get(k, fill) for k in ks], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op, group=group)
        if kind == "mean":
            n = torch.tensor([float(k in m) for k in ks], dtype=torch.float64, device=dev)
            dist.all_reduce(n, group=group)
            t /= n
        out.update(zip(ks, t.tolist()))
    return out


def host_floats(m: dict) -> dict[str, float]:
    """{key: float(value)} of a metrics dict whose values are Python numbers or one-element tensors, the tensors
    read to the host together (one device-to-host copy, not one synchronization per metric)."""
    keys = [k for k, v in m.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in m.items() if not isinstance(v, torch.Tensor)}
    if keys:
        out.update(zip(keys, torch.stack([m[k].detach().reshape(()).double() for k in keys]).tolist()))
    return {k: out[k] for k in m}


class StepTimer:
    """`with timer("rollout"): ...` accumulates wall seconds per phase; `pop()` returns {'time/<phase>': s}."""

    def __init__(self):
        self.t: dict[str, float] = {}
        # CUDA work is asynchronous: a phase ends when its kernels do, not when Python leaves the block
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"moe_gspo/{name}"):  # the phase, in a profile's trace
                yield
        finally:
            self._sync()
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.t.items()}
        self.t = {}
        return out


def device_busy_ms(events) -> float:
    """Milliseconds the device spent in kernels, memcpys and memsets, from torch.profiler's key_averages(). Each
    kernel is listed twice there, as a device row of its own and inside the self device time of the operator that
    launched it, so only the device rows count (as torch's own table totals them), user annotations left out."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e3


def costliest(events, top: int) -> tuple[float, list[dict]]:
    """(busy ms, the `top` costliest operators and kernels as {name, calls, ms, share}) of torch.profiler's
    key_averages(): on a GPU by self device time, busy being the kernels' own time (device_busy_ms); otherwise by
    self CPU time, busy being all of it. The StepTimer's `moe_gspo/<phase>` ranges are left out."""
    cuda = any(e.device_type != torch.autograd.DeviceType.CPU for e in events)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = device_busy_ms(events) if cuda else sum(e.self_cpu_time_total for e in events) / 1e3
    ops = sorted((e for e in events if not e.key.startswith("moe_gspo/")), key=lambda e: -getattr(e, key))[:top]
    return busy, [{"name": e.key, "calls": e.count, "ms": getattr(e, key) / 1e3,
                   "share": getattr(e, key) / 1e3 / max(busy, 1e-9)} for e in ops]


@contextmanager
def step_profile(run_dir: Path, step: int, enabled: bool, top: int = 30):
    """Profile the block with torch.profiler when `enabled` (CPU activity, and CUDA's when a GPU is present) and
    write RUN_DIR/profile_step_<step>.txt, the summary, and RUN_DIR/profile_step_<step>.json.gz, a gzipped Chrome
    trace. The summary gives the wall time (on a GPU also the kernels' summed time: well under the wall time, the
    step waits on launches and host syncs rather than kernels), each `moe_gspo/<phase>` range the StepTimer marks,
    the `top` costliest operators and kernels, and on a GPU the host syncs by call site (`host_syncs`)."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with (profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof,
          host_syncs() as syncs):
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy, ops = costliest(events, top)
    phases = sorted((e for e in events if e.key.startswith("moe_gspo/")), key=lambda e: -e.cpu_time_total)
    where = "device" if cuda else "CPU"
    head = f"RL step {step}, profiled: {wall * 1e3:.1f} ms wall"
    lines = [head + (f", {busy:.1f} ms of kernel time on the device" if cuda else ""),
             "", f"{'phase':40s} {'ms (wall, CPU side)':>20s}"]
    lines += [f"{e.key:40s} {e.cpu_time_total / 1e3:20.1f}" for e in phases]
    lines += ["", f"{'operator or kernel':80s} {'calls':>7s} {where + ' ms':>10s} {'share':>6s}"]
    lines += [f"{r['name'][:80]:80s} {r['calls']:7d} {r['ms']:10.2f} {r['share']:6.1%}" for r in ops]
    if cuda:  # each one stalls the host until the device drains its queue: no launches run ahead meanwhile
        lines += ["", f"host syncs: {sum(syncs.values())} (torch.cuda.set_sync_debug_mode), by call site",
                  *(f"{n:7d}  {where}" for where, n in syncs.most_common(top))]
    (run_dir / f"profile_step_{step}.txt").write_text("\n".join(lines) + "\n")
    trace = run_dir / f"profile_step_{step}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:  # a tenth of the size; Perfetto reads it
        shutil.copyfileobj(f, z)
    trace.unlink()


TENSORBOARD_ROOM = 1 << 20
"""Free bytes TensorBoard's writer is started with at least. On a full disk its background thread fails on the
event file's first record and prints that thread's traceback whatever the caller catches; this keeps it from
starting there."""


def _room_for_tensorboard(d: Path) -> None:
    """OSError(ENOSPC) naming `d` when its file system has less than TENSORBOARD_ROOM free."""
    if free_bytes(d) < TENSORBOARD_ROOM:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d))


class MetricsWriter:
    """metrics.jsonl (one line per step), tensorboard event files in the run directory and, with a W&B project,
    a Weights & Biases run; no-op off rank 0."""

    def __init__(self, run_dir: Path, jsonl: bool = True, tensorboard: bool = True, active: bool = True,
                 wandb_run: WandbRun | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.active, self.jsonl = active, jsonl
        self.tb = None
        if active and tensorboard:
            _room_for_tensorboard(Path(run_dir) / "tensorboard")
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard missing: JSONL still works
                self.tb = None
        self.wandb = wandb_run.start(Path(run_dir)) if active and wandb_run is not None else None  # the run object

    @classmethod
    def for_run(cls, run_dir: Path, logc, config: dict, active: bool, resume: bool) -> MetricsWriter:
        """The writer a run's `logging:` section (logc) asks for; config: the run's config as a dict (what W&B
        shows for the run); resume: the run continues from a checkpoint (and so does its W&B run)."""
        wb = None
        if logc.wandb_project is not None:
            wb = WandbRun(logc.wandb_project, logc.wandb_run_name or Path(run_dir).name, logc.wandb_entity, config,
                          resume)
        return cls(run_dir, logc.jsonl, logc.tensorboard, active, wb)

    def truncate_after(self, step: int) -> None:
        """Drop lines with step > `step` (a resumed run rewrites them; step 0 empties the file)."""
        if not (self.active and self.path.exists()):
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:  # a line cut by a crash
                continue
        tmp = self.path.with_name(f".{self.path.name}.tmp")  # whole or not at all: written aside, then renamed
        try:
            tmp.write_text("".join(x + "\n" for x in keep))
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: nothing left beside the file, which is as it was
            raise
        os.replace(tmp, self.path)

    def write(self, step: int, m: dict[str, float]) -> None:
        if not self.active:
            return
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **m}) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(m, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


@dataclass(frozen=True)
class WandbRun:
    """What the writing rank's Weights & Biases run is (logging.wandb_*); only `start` imports wandb, so that this
    package never imports it for a run without a project."""

    project: str
    name: str
    entity: str | None
    config: dict
    resume: bool
    ID_FILE: ClassVar[str] = "wandb_run_id"
    """RUN_DIR/wandb_run_id: the W&B run's id, which a resumed run continues."""

    @staticmethod
    def check(project: str | None) -> None:
        """ConfigError, before anything is built, when a project is set and wandb cannot be imported."""
        if project is None:
            return
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"logging.wandb_project={project!r} needs wandb: pip install wandb") from None

    def start(self, run_dir: Path):
        """wandb.init in RUN_DIR (its files under RUN_DIR/wandb/); the run object. A resumed run reuses the id it
        finds in RUN_DIR/wandb_run_id; W&B drops the steps it already holds when they are logged again."""
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"logging.wandb_project={self.project!r} needs wandb: pip install wandb") from None
        id_file = run_dir / self.ID_FILE
        same = {"id": id_file.read_text().strip(), "resume": "allow"} if self.resume and id_file.is_file() else {}
        run = wandb.init(project=self.project, name=self.name, entity=self.entity, config=self.config,
                         dir=str(run_dir), **same)
        id_file.write_text(run.id + "\n")
        return run


def _clock(seconds: float) -> str:
    """h:mm:ss, as rich's bar shows times."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Rank 0's view of the run's progress, when enabled: on a terminal, a rich progress bar with the key figures of
    the last step; otherwise (stdout in a file, as under nohup or a batch queue) one plain line per step, flushed,
    which a log tail shows as it comes."""

    KEYS = (("reward", "reward/mean"), ("clip", "pg_clipfrac"), ("flip", "moe/flip_rate"),
            ("eval", "eval/accuracy"), ("s/step", "time/step"))

    def __init__(self, total: int, start: int, label: str, enabled: bool, stream=None):
        self.bar = self.stream = None
        if not enabled:
            return
        stream = stream or sys.stdout
        if not stream.isatty():
            self.stream, self.total, self.step, self.label, self.spent = stream, total, start, label, []
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=12), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                TextColumn("{task.fields[info]}"), transient=False)
        self.bar.start()
        self.task = self.bar.add_task(label, total=total, completed=start, info="")

    def update(self, m: dict[str, float]) -> None:
        info = "  ".join(f"{name} {m[k]:.3g}" for name, k in self.KEYS if k in m)
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif self.stream is not None:
            self.step += 1
            if "time/step" in m:
                self.spent.append(m["time/step"])
            left = self.total - self.step
            eta = sum(self.spent) / len(self.spent) * left if self.spent else 0.0
            print(f"{self.label} step {self.step}/{self.total}  {info}  eta {_clock(eta)}", file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
