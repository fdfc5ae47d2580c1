"""`moe-gspo study volatility`: the expert flip rate as a function of depth, learning rate, off-policy degree and
expert granularity.

    moe-gspo study volatility --config configs/studies/volatility_cpu.yaml --out DIR [--jobs K] [--overwrite]
                              [a.b=v ...]
    run_volatility_study("configs/studies/volatility_cpu.yaml", "runs/volatility")   # -> DIR/report.html

The config is an ordinary run config (the base point of the grid) plus a `study:` section (StudyConfig):

    study:
      depths: [2, 4, 8, 16, 32, 48]   # model.num_hidden_layers, at the base lr and minibatches
      lrs: [1.0e-4, 3.0e-4, 1.0e-3]   # train.lr, at base_depth and the base minibatches
      minibatches: [1, 2, 4, 8]       # train.minibatches (optimizer steps per rollout batch), at base_depth, base lr
      base_depth: 4                   # depth of the lr and minibatch sweeps (default: model.num_hidden_layers)
      experts: [8, 32, 128]           # granularity sweep: model.num_experts x model.num_experts_per_tok (top-k <=
      top_ks: [2, 4, 8]               #   experts), moe_intermediate_size = active_width // top-k
      active_width: 256               # top-k x expert width held fixed (default: the run config's product)
      granularity_depths: [4, 16]     # depths of the granularity sweep (default: [base_depth])
      seeds: 2                        # every point runs with train.seed + 0 .. seeds-1
      steps: 4                        # RL steps per run (default: train.steps)
      jobs: 2                         # groups at a time, one process each (--jobs wins; default 1)

The base lr and minibatches are train.lr and train.minibatches. The grid is the union of the one-factor sweeps
through the base point and, when `experts` and `top_ks` are given, the granularity sweep: every (experts, top-k)
pair with top-k <= experts at each of granularity_depths, at the base lr and minibatches, with the active expert
width per token (top-k x moe_intermediate_size) held at active_width. A point shared by two sweeps runs once.
Every point runs the same task, the same prompts and sampling seeds, with algorithm.track_flips on. Seed s has one
cold start per model (depth and expert layout; train.seed = s sets the initial weights and the demonstrations),
shared by the points of that model, which differ only in RL settings; so those points start RL from identical
weights. A seed's cold start of one model and the runs from it form a group; `jobs` groups run at a time, each in
a spawned process with cores // jobs threads. Each run
writes DIR/<point>/seed_<s>/ (metrics.jsonl with moe/flip_rate and moe/flip_rate/layer_<i> per step, config.yaml,
wall_time.json); then DIR/study.json (grid, seeds, seconds, machine load) and the report
(moe_gspo/report/volatility_study.py): DIR/report.html, DIR/study_table.csv and the figures beside them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_gspo.config import ConfigError, apply_overrides, config_from_dict, read_yaml
from moe_gspo.experiments.compare import cold_start_key, cold_start_state, run_config, train_one
from moe_gspo.train import data


MOE_KEYS = ("experts", "top_k", "expert_width")  # a point's expert layout in study.json


@dataclass(frozen=True)
class StudyConfig:
    """The `study:` section of a `moe-gspo study volatility` config (not part of a run's Config)."""

    depths: tuple[int, ...] = (2, 4, 8, 16, 32, 48)
    """MoE layer counts of the depth sweep (model.num_hidden_layers), run at the base lr and minibatches."""
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    """Learning rates of the lr sweep (train.lr), run at base_depth and the base minibatches."""
    minibatches: tuple[int, ...] = (1, 2, 4, 8)
    """Optimizer steps per rollout batch of the minibatch sweep (train.minibatches), at base_depth and the base lr.
    Minibatch k of a step is observed after k - 1 updates, so 1 measures no update at all (numeric noise only)."""
    base_depth: int | None = None
    """Depth of the lr and minibatch sweeps; None takes model.num_hidden_layers of the run config."""
    seeds: int = 2
    """Seeds per point: runs use train.seed + 0 .. seeds-1, the same for every point."""
    steps: int | None = None
    """RL steps per run; None takes train.steps of the run config."""
    jobs: int = 1
    """Groups (a seed's cold start at one depth and the runs that start from it) run at a time, each in its own
    process with cores // jobs threads (--jobs wins). Tiny models gain little from a second thread and lose much
    when another process takes the core a thread waits on, so one process per core is the faster use of a
    machine."""

    experts: tuple[int, ...] = ()
    """model.num_experts of the granularity sweep (with top_ks; empty: no granularity sweep)."""
    top_ks: tuple[int, ...] = ()
    """model.num_experts_per_tok of the granularity sweep; pairs with top-k > experts are skipped."""
    active_width: int | None = None
    """top-k x moe_intermediate_size, held fixed across the granularity sweep (each point's expert width is
    active_width // top-k, which must divide evenly); None takes the run config's product."""
    granularity_depths: tuple[int, ...] = ()
    """Depths of the granularity sweep; empty takes (base_depth,)."""

    def __post_init__(self):
        for name in ("experts", "top_ks", "granularity_depths"):
            vals = getattr(self, name)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vals):
                raise ConfigError(f"study.{name}={list(vals)!r} must be a list of integers >= 1")
        if bool(self.experts) != bool(self.top_ks):
            raise ConfigError(f"study.experts={list(self.experts)!r} and study.top_ks={list(self.top_ks)!r} must "
                              f"both be given (the granularity sweep) or both be empty")
        if self.experts and not any(k <= e for e in self.experts for k in self.top_ks):
            raise ConfigError(f"study.top_ks={list(self.top_ks)!r}: no top-k is <= any of study.experts="
                              f"{list(self.experts)!r}")
        for name, lo in (("depths", 1), ("minibatches", 1)):
            vals = getattr(self, name)
            if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in vals):
                raise ConfigError(f"study.{name}={list(vals)!r} must be a non-empty list of integers >= {lo}")
        if not self.lrs or not all(isinstance(v, float) and v > 0 for v in self.lrs):
            raise ConfigError(f"study.lrs={list(self.lrs)!r} must be a non-empty list of numbers > 0")
        for name in ("base_depth", "steps", "active_width"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"study.{name}={v!r} must be an integer >= 1")
        for name in ("seeds", "jobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"study.{name}={v!r} must be an integer >= 1")


def study_config_from_dict(section) -> StudyConfig:
    """A validated StudyConfig from the `study:` mapping; unknown keys and bad values raise ConfigError naming them."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"study must be a mapping of {[f.name for f in dataclasses.fields(StudyConfig)]}, "
                          f"got {type(section).__name__}")
    valid = [f.name for f in dataclasses.fields(StudyConfig)]
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ConfigError(f"unknown keys under 'study': {unknown}; valid: {valid}")
    kw = dict(section)
    for name in ("depths", "lrs", "minibatches", "experts", "top_ks", "granularity_depths"):
        if name in kw:
            v = kw[name]
            if not isinstance(v, list):
                raise ConfigError(f"study.{name}={v!r} must be a list")
            kw[name] = tuple(_number(x, f"study.{name}") for x in v) if name == "lrs" else tuple(v)
    return StudyConfig(**kw)


def _number(x, where: str) -> float:
    """A YAML number as float; YAML 1.1 reads '3e-4' as a string, which is accepted too."""
    if isinstance(x, bool):
        raise ConfigError(f"{where}: {x!r} is not a number")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {x!r} is not a number") from None


@dataclass(frozen=True)
class Point:
    """One grid point: a model depth, a learning rate, minibatches per rollout batch and, for the granularity sweep,
    an expert layout (num_experts, num_experts_per_tok, moe_intermediate_size); None keeps the run config's."""

    depth: int
    lr: float
    minibatches: int
    moe: tuple[int, int, int] | None = None

    @property
    def name(self) -> str:
        base = f"L{self.depth}_lr{self.lr:g}_mb{self.minibatches}"
        return base if self.moe is None else f"{base}_E{self.moe[0]}k{self.moe[1]}"

    def overrides(self, steps: int) -> list[str]:
        moe = [] if self.moe is None else [f"model.num_experts={self.moe[0]}", f"model.num_experts_per_tok="
                                           f"{self.moe[1]}", f"model.moe_intermediate_size={self.moe[2]}"]
        return [f"model.num_hidden_layers={self.depth}", *moe, f"train.lr={self.lr!r}",
                f"train.minibatches={self.minibatches}", f"train.steps={steps}", "algorithm.track_flips=true"]

    def sort_key(self) -> tuple:
        return (self.depth, self.lr, self.minibatches, self.moe or (0, 0, 0))


@dataclass(frozen=True)
class Grid:
    """The study's points (sorted by depth, then lr, then minibatches), its base point, seeds and steps."""

    points: tuple[Point, ...]
    base: Point
    seeds: tuple[int, ...]
    steps: int


def read_study_config(path, overrides=None) -> tuple[dict, StudyConfig, Grid]:
    """(base run config dict, study settings, grid), overrides applied (`study.seeds=1` sets the study section);
    every point's run config is validated before any compute."""
    path = Path(path)
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    try:
        study = study_config_from_dict(raw.pop("study", None))
        base_cfg = config_from_dict(copy.deepcopy(raw))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    steps = study.steps or base_cfg.train.steps
    base = Point(study.base_depth or base_cfg.model.num_hidden_layers, base_cfg.train.lr, base_cfg.train.minibatches)
    pts = {Point(d, base.lr, base.minibatches) for d in study.depths}
    pts |= {Point(base.depth, lr, base.minibatches) for lr in study.lrs}
    pts |= {Point(base.depth, base.lr, m) for m in study.minibatches}
    try:
        pts |= _granularity_points(study, base, base_cfg.model)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    points = tuple(sorted(pts, key=Point.sort_key))
    seeds = tuple(base_cfg.train.seed + i for i in range(study.seeds))
    for p in points:  # every point must build and lay out its batch before anything runs
        try:
            cfg = run_config(raw, p.overrides(steps), seeds[0])
            data.check_names(cfg)
            data.check_layout(cfg, max(1, data.world_size() // cfg.parallel.tp))
        except ConfigError as e:
            raise ConfigError(f"{path}: point {p.name}: {e}") from None
    return raw, study, Grid(points, base, seeds, steps)


def _granularity_points(study: StudyConfig, base: Point, model) -> set[Point]:
    """Every (experts, top-k) pair with top-k <= experts at each granularity depth, the active width held fixed; the
    run config's own layout is the plain point of that depth (moe None), so it runs once."""
    if not study.experts:
        return set()
    own = (model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size)
    active = study.active_width or own[1] * own[2]
    pts = set()
    for k in study.top_ks:
        if active % k:
            raise ConfigError(f"study.active_width={active} is not a multiple of top-k {k} (study.top_ks): the "
                              f"expert width would not be an integer")
        for e in study.experts:
            if k <= e:
                moe = (e, k, active // k)
                pts |= {Point(d, base.lr, base.minibatches, None if moe == own else moe)
                        for d in study.granularity_depths or (base.depth,)}
    return pts


@dataclass(frozen=True)
class Group:
    """The runs of one seed on one model (depth and expert layout): one cold start, then every point of that model
    from its weights (they differ only in RL settings, which the cold start never reads)."""

    seed: int
    depth: int
    points: tuple[Point, ...]
    moe: tuple[int, int, int] | None = None

    def cost(self, steps: int, cold_start_steps: int) -> float:
        """Relative compute: layers x (supervised steps + about 6 forward-equivalents per RL step and minibatch)."""
        return self.depth * (cold_start_steps + steps * sum(2 + p.minibatches for p in self.points))


def plan_groups(grid: Grid) -> list[Group]:
    """Seed-major, then by depth and expert layout."""
    models = sorted({(p.depth, p.moe) for p in grid.points}, key=lambda m: (m[0], m[1] or (0, 0, 0)))
    return [Group(seed, d, tuple(p for p in grid.points if (p.depth, p.moe) == (d, moe)), moe)
            for seed in grid.seeds for d, moe in models]


def run_group(raw: dict, group: Group, steps: int, out: Path) -> dict:
    """Cold-start the group's depth at its seed, then train each of its points into out/<point>/seed_<s>/.
    Returns {"walls": {run: s}, "cold": {"L<d>/seed_<s>": s}, "loads": [...], "cpu": s} (cpu: this process's
    CPU seconds, all threads)."""
    cpu0 = time.process_time()
    cfg = run_config(raw, group.points[0].overrides(steps), group.seed)
    key = cold_start_key(cfg)
    model = f"L{group.depth}" + ("" if group.moe is None else f"_E{group.moe[0]}k{group.moe[1]}")
    _say(f"cold start: seed {group.seed}, {model}, {cfg.train.cold_start_steps} supervised steps")
    t = time.perf_counter()
    state = cold_start_state(cfg)
    res = {"walls": {}, "cold": {f"{model}/seed_{group.seed}": time.perf_counter() - t}, "loads": []}
    for p in group.points:
        cfg = run_config(raw, p.overrides(steps), group.seed)
        if cold_start_key(cfg) != key:
            raise RuntimeError(f"point {p.name} needs a cold start of its own; a group shares one")
        label = f"{p.name}/seed_{group.seed}"
        res["walls"][label] = train_one(cfg, out / p.name / f"seed_{group.seed}", state, label, p.overrides(steps))
        res["loads"].append((_load_average() or [float("nan")])[0])
        _say(f"{label}: {res['walls'][label]:.0f} s")
    res["cpu"] = time.process_time() - cpu0
    return res


def run_volatility_study(config_path, out_dir, overrides=None, overwrite: bool = False,
                         jobs: int | None = None) -> Path:
    """Train every point of the grid at every seed into out_dir/<point>/seed_<s>/, then write out_dir/study.json and
    the report; returns the report's path. `jobs` (default study.jobs) groups run at a time, each in its own
    process with cores // jobs threads. A directory holding a previous study is refused unless overwrite=True."""
    import torch
    import torch.distributed as dist

    from moe_gspo.report.volatility_study import write_study_report
    from moe_gspo.checkpoint.run_lock import RunLock

    raw, study, grid = read_study_config(config_path, overrides)
    jobs = study.jobs if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs={jobs} must be >= 1")
    if jobs > 1 and data.world_size() > 1:
        raise ConfigError(f"--jobs={jobs} starts its own processes and cannot run under torchrun (use --jobs 1)")
    out = Path(out_dir)
    if (out / "study.json").exists() and not overwrite:
        raise ConfigError(f"{out} holds a previous study (study.json): pass --overwrite to replace it or choose "
                          f"another --out")
    with RunLock.held(out, active=data.world_rank() == 0):  # one study per directory, as one run per run directory
        groups = plan_groups(grid)
        threads = max(1, torch.get_num_threads() // jobs)
        load_start = _load_average()
        t0 = time.perf_counter()
        if jobs == 1:
            results = [run_group(raw, g, grid.steps, out) for g in groups]
        else:
            results = _run_in_processes(raw, groups, grid.steps, out, jobs, threads)
        if dist.is_initialized() and dist.get_rank() != 0:
            return out / "report.html"
        walls = {k: v for r in results for k, v in r["walls"].items()}
        loads = [x for r in results for x in r["loads"]]
        own = config_from_dict(copy.deepcopy(raw)).model
        own = (own.num_experts, own.num_experts_per_tok, own.moe_intermediate_size)
        meta = {"points": [{"name": p.name, "depth": p.depth, "lr": p.lr, "minibatches": p.minibatches,
                            **dict(zip(MOE_KEYS, p.moe or own))} for p in grid.points],
                "granularity": {"depths": list(study.granularity_depths or (grid.base.depth,)),
                                "experts": list(study.experts), "top_ks": list(study.top_ks)} if study.experts else None,
                "base": dataclasses.asdict(grid.base) | dict(zip(MOE_KEYS, own)), "seeds": list(grid.seeds),
                "steps": grid.steps,
                "study": dataclasses.asdict(study),
                "wall_seconds": {f"{p.name}/seed_{s}": walls[f"{p.name}/seed_{s}"] for s in grid.seeds
                                 for p in grid.points},
                "cold_start_seconds": {k: v for r in results for k, v in r["cold"].items()},
                "total_seconds": time.perf_counter() - t0, "cpu_seconds": sum(r["cpu"] for r in results),
                "jobs": jobs, "threads": threads, "cpus": os.cpu_count(),
                "load_average": {"start": load_start, "end": _load_average(),
                                 "mean_over_runs": sum(loads) / len(loads) if loads else None}}
        (out / "study.json").write_text(json.dumps(meta, indent=1))
        return write_study_report(out)


def _run_in_processes(raw: dict, groups: list[Group], steps: int, out: Path, jobs: int, threads: int) -> list[dict]:
    """The groups, `jobs` at a time in spawned processes with `threads` threads each, the costliest first (so that
    the last to finish is a small one). A run's metrics depend on its config, weights and thread count only, so
    they equal a --jobs 1 study run with the same threads. The first failure cancels the groups not started."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    cold = config_from_dict(copy.deepcopy(raw)).train.cold_start_steps
    order = sorted(groups, key=lambda g: g.cost(steps, cold), reverse=True)
    _say(f"{len(groups)} groups (a cold start and its runs), {jobs} at a time, {threads} thread(s) each")
    results = []
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(threads,))
    try:
        futures = [pool.submit(run_group, raw, g, steps, out) for g in order]
        for i, fut in enumerate(as_completed(futures), 1):
            results.append(fut.result())
            _say(f"[{i}/{len(groups)} groups done]")
    finally:
        pool.shutdown(cancel_futures=True)
    return results


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (None where the OS has none): timings are only comparable at
    equal load, so the study records it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _say(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(msg, file=sys.stderr, flush=True)
