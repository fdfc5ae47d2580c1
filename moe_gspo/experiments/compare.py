"""`moe-gspo compare`: GRPO, GRPO + R2, GRPO + R3, GSPO and GSPO-token on the same model, data and seeds.

    moe-gspo compare --config configs/compare_tiny_cpu.yaml --out DIR [--only grpo,gspo] [--seeds N] [--jobs K]
                     [--resume | --overwrite] [a.b=v ...]

The config is an ordinary run config plus a `compare:` section (fields: moe_gspo.config.CompareConfig):

    compare:
      seeds: 3                       # runs per variant, with train.seed + 0, 1, 2 (--seeds wins)
      jobs: 2                        # runs at a time, in separate processes (--jobs wins)
      variants:                      # name -> overrides applied on top of the shared config (default: below)
        grpo: [algorithm.loss=grpo]                 # routing_replay defaults to off
        ...

Every variant runs with the same seeds (paired). Seed s sets train.seed = s for the run (initial weights, prompts,
sampling) and has its own cold start: the supervised stage runs once per seed (and per distinct model / task /
cold-start settings among the variants), and every variant of that seed starts from its weights, which are kept in
DIR/cold_start/seed_<s>.safetensors. So step 1's rollouts of one seed are identical across variants, and the spread
over seeds includes the spread of the cold start. Each run writes DIR/<variant>/seed_<s>/ (metrics.jsonl,
tensorboard, checkpoints, wall_time.json); then DIR/compare.json and DIR/report.html (moe_gspo/report/compare.py).

`--jobs K` runs K cold starts, then K variant-seed runs, at a time, each in its own process (`python -m moe_gspo.cli
compare --cold-start-to WEIGHTS` / `--run-one WEIGHTS`, reading its config from YAML and writing or reading the
weights as safetensors) with OMP_NUM_THREADS = T // K, T being the threads of the calling process (OMP_NUM_THREADS,
else the cores), and its output in DIR/<variant>/seed_<s>/log.txt (DIR/cold_start/seed_<s>.log).
A run's metrics depend on its config, its weights and its thread count only, not on the runs beside it: `--jobs K`
equals `--jobs 1` under OMP_NUM_THREADS = T // K bit for bit (CPU kernels split float reductions by thread, so
runs with 1 and with 2 threads differ in rounding).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_gspo.config import (CompareConfig, ConfigError, UserError, apply_overrides, compare_config_from_dict,
                             config_from_dict, load_config, read_yaml, to_dict)
from moe_gspo.train.data import check_names

DEFAULT_VARIANTS = {
    "grpo": ["algorithm.loss=grpo"],
    "grpo_r2": ["algorithm.loss=grpo", "algorithm.routing_replay=r2"],
    "grpo_r3": ["algorithm.loss=grpo", "algorithm.routing_replay=r3"],
    "gspo": ["algorithm.loss=gspo"],
    "gspo_token": ["algorithm.loss=gspo_token"],
}

# train.* fields the supervised cold start never reads: variants that differ only in these share a cold start
_RL_ONLY_TRAIN = {"steps", "lr", "lr_warmup_steps", "lr_decay", "min_lr", "minibatches", "micro_batch_size",
                  "logprob_micro_batch_size", "seq_len", "batch_size", "checkpoint_every", "keep_checkpoints",
                  "out_dir", "logprob_impl", "loss_impl", "router_lr_scale", "max_staleness", "routing_noise"}


@dataclass(frozen=True)
class Job:
    """One run of a comparison: a variant at a seed, trained into `dir` from the cold-start weights `init`."""

    variant: str
    seed: int
    overrides: tuple[str, ...]
    dir: Path
    init: Path

    @property
    def label(self) -> str:
        return f"{self.variant}/seed_{self.seed}"


def read_compare_config(path, overrides=None) -> tuple[dict, dict[str, list[str]], CompareConfig]:
    """(shared config dict, {variant name: its overrides}, the compare settings), overrides applied (a
    `compare.seeds=3` override sets the compare section); every variant is validated before any compute."""
    path = Path(path)
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    section = raw.pop("compare", None) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'compare' must be a mapping")
    valid = ["variants", *(f.name for f in dataclasses.fields(CompareConfig))]
    unknown = set(section) - set(valid)
    if unknown:
        raise ConfigError(f"{path}: unknown keys under 'compare': {sorted(unknown)}; valid: {valid}")
    try:
        settings = compare_config_from_dict({k: v for k, v in section.items() if k != "variants"})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    variants = section.get("variants") or DEFAULT_VARIANTS
    if not isinstance(variants, dict) or not all(isinstance(v, list) for v in variants.values()):
        raise ConfigError(f"{path}: compare.variants must map names to lists of 'a.b=value' overrides")
    for name in variants:
        if not isinstance(name, str) or not name or "/" in name or name in ("cold_start",) or name.startswith("."):
            raise ConfigError(f"{path}: compare.variants: {name!r} cannot name a run directory")
    for name, ovs in variants.items():  # validate every variant before spending any compute
        try:
            check_names(config_from_dict(apply_overrides(copy.deepcopy(raw), [str(x) for x in ovs])))
        except ConfigError as e:
            raise ConfigError(f"{path}: variant {name!r}: {e}") from None
    return raw, {k: [str(x) for x in v] for k, v in variants.items()}, settings


def run_config(base: dict, overrides, seed: int, extra=()):
    """The Config of one run: the shared dict, the variant's overrides, train.seed = seed, then `extra`."""
    return config_from_dict(apply_overrides(copy.deepcopy(base), [*overrides, f"train.seed={seed}", *extra]))


def cold_start_key(cfg) -> str:
    """What the cold start of `cfg` depends on (model, parallel layout, task, seed and cold-start settings)."""
    d = to_dict(cfg)
    train = {k: v for k, v in d["train"].items() if k not in _RL_ONLY_TRAIN}
    task = {k: d["rollout"][k] for k in ("task", "task_args", "dataset_path", "prompt_field", "answer_field",
                                         "demonstration_field", "chat_template", "chat_template_kwargs")}
    return json.dumps([d["model"], d["parallel"], task, train], sort_keys=True)


def cold_start_state(cfg) -> dict:
    """Run the cold-start stage once on a fresh policy; return its full (unsharded) weights."""

    from moe_gspo.model.load import init_parallel, load_policy
    from moe_gspo.parallel.state import parallel_info
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.data import PromptIds, build_tokenizer, cold_start_plan, template_kwargs
    from moe_gspo.train.optim import release_ddp, wrap_ddp
    from moe_gspo.train.step import cold_start

    groups = init_parallel(cfg)
    policy = load_policy(cfg, groups)
    info = parallel_info(groups)
    task = task_from_config(cfg.rollout)
    steps, why_not = cold_start_plan(cfg, task, False)
    if why_not:
        _say(why_not)
    if steps:
        ddp = wrap_ddp(policy, cfg.train.distributed_optimizer)
        tok = build_tokenizer(cfg)
        cold_start(policy, ddp, cfg.train, task, tok, info.dp, info.dp_rank, prompt_ids=PromptIds(cfg, tok),
                   tools=template_kwargs(cfg.rollout).get("tools"))
        release_ddp(ddp)
    return {k: v.detach().clone().contiguous() for k, v in policy.full_megatron_state().items()}


def plan_jobs(out: Path, base: dict, variants: dict[str, list[str]], seeds: list[int]) -> tuple[list[Job], dict]:
    """The runs (seed-major) and, per cold-start weights file, the config that produces it."""
    jobs, files = [], {}
    for seed in seeds:
        keys = {name: cold_start_key(run_config(base, ovs, seed)) for name, ovs in variants.items()}
        groups = list(dict.fromkeys(keys.values()))  # distinct cold starts of this seed, in variant order
        for name, ovs in variants.items():
            first = next(n for n in variants if keys[n] == keys[name])
            f = out / "cold_start" / (f"seed_{seed}.safetensors" if len(groups) == 1 else
                                      f"seed_{seed}_{first}.safetensors")
            files.setdefault(f, run_config(base, variants[first], seed))
            jobs.append(Job(name, seed, tuple(ovs), out / name / f"seed_{seed}", f))
    return jobs, files


def run_comparison(config_path, out_dir, overrides=None, only=None, overwrite: bool = False,
                   seeds: int | None = None, jobs: int | None = None, resume: bool = False) -> Path:
    """Run every variant at every seed into out_dir/<name>/seed_<s>/ and write out_dir/report.html; returns the
    report's path. `seeds` and `jobs` (the --seeds and --jobs options) replace compare.seeds and compare.jobs;
    jobs > 1 runs that many cold starts, then that many runs, at a time in separate processes. A directory that
    already holds a comparison is refused unless overwrite=True or resume=True. With resume, every cold start and
    run already finished in out_dir under the same config is kept (see reusable_work) and only the rest run: an
    interrupted comparison completes, and a larger --seeds adds seeds to a finished one."""
    import torch.distributed as dist

    from moe_gspo.report.compare import write_compare_report

    for name, value in (("--seeds", seeds), ("--jobs", jobs)):
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    base, variants, settings = read_compare_config(config_path, overrides)
    settings = dataclasses.replace(settings, **{k: v for k, v in (("seeds", seeds), ("jobs", jobs)) if v is not None})
    jobs = settings.jobs
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"--jobs={jobs} (or compare.jobs) starts its own processes and cannot run under torchrun "
                          "(use --jobs 1)")
    if only:
        missing = [n for n in only if n not in variants]
        if missing:
            raise ConfigError(f"--only {missing}: not among the variants {list(variants)}")
        variants = {n: variants[n] for n in only}
    out = Path(out_dir)
    if overwrite and resume:
        raise ConfigError("--overwrite and --resume exclude each other (replace the comparison, or complete it)")
    if (out / "compare.json").exists() and not (overwrite or resume):
        raise ConfigError(f"{out} holds a previous comparison (compare.json): pass --resume to keep its finished "
                          f"runs and run the rest, --overwrite to replace it, or choose another --out")
    from moe_gspo.train.data import world_rank
    from moe_gspo.train.loop import writable_dir
    from moe_gspo.checkpoint.run_lock import RunLock

    writable_dir(out, "--out directory")
    with RunLock.held(out, active=world_rank() == 0):  # one comparison per directory, as one run per run directory
        seed_list = [config_from_dict(copy.deepcopy(base)).train.seed + i for i in range(settings.seeds)]
        plan, files = plan_jobs(out, base, variants, seed_list)
        kept_cold, kept_runs = reusable_work(plan, files, base) if resume else ({}, {})
        if resume:
            _say(f"--resume: keeping {len(kept_cold)} of {len(files)} cold start(s) and {len(kept_runs)} of "
                 f"{len(plan)} runs finished in {out} under this config")
        todo = [job for job in plan if job.label not in kept_runs]
        todo_files = {f: cfg for f, cfg in files.items() if f.name not in kept_cold}
        t0 = time.perf_counter()
        threads = max(1, _thread_budget() // jobs)
        if kept_runs and todo:
            _warn_on_thread_change(kept_runs, threads, len(todo))
        separate = any(run_config(base, j.overrides, j.seed).rollout.placement == "separate" for j in todo)
        if jobs == 1 and not separate:
            cold_s, walls = _run_in_process(todo, todo_files, base)
        else:
            cold_s, walls = _run_in_processes(todo, todo_files, base, jobs, threads)
        cold_s = {f.name: kept_cold.get(f.name, cold_s.get(f.name)) for f in files}
        walls = {job.label: kept_runs[job.label]["seconds"] if job.label in kept_runs else walls.get(job.label)
                 for job in plan}
        if dist.is_initialized() and dist.get_rank() != 0:
            return out / "report.html"
        meta = {"variants": variants, "seeds": seed_list, "jobs": jobs, "threads_per_run": threads,
                "settings": dataclasses.asdict(settings), "wall_seconds": walls, "cold_start_seconds": cold_s,
                "total_seconds": time.perf_counter() - t0}
        (out / "compare.json").write_text(json.dumps(meta, indent=1))
        return write_compare_report(out, list(variants), walls)


def _comparable(config: dict) -> dict:
    """A run's config without the fields that cannot change its results (progress bar, output directory)."""
    d = copy.deepcopy(config)
    d.get("logging", {}).pop("progress", None)
    d.get("train", {}).pop("out_dir", None)
    return d


# What reading a kept record can raise when the file is damaged (a truncated write, an edit by hand): OSError (an
# unreadable file), ValueError (JSON or YAML that does not parse, a config that does not validate, a seconds field
# that is not a number), KeyError (no seconds field), TypeError (a record that is not a JSON object).
_DAMAGED = (OSError, ValueError, KeyError, TypeError)


def reusable_work(plan: list[Job], files: dict, base: dict) -> tuple[dict[str, float], dict[str, dict]]:
    """What --resume keeps: ({weights file name: seconds} of the finished cold starts, {run label: its
    wall_time.json record (seconds, threads, ...)} of the finished runs). A cold start is finished when its
    weights, its seconds (.json, written after the weights) and its config (.yaml) are on disk and the config has
    the planned cold start's model, layout, task, seed and supervised settings. A run is finished when its
    wall_time.json (written after training) and config.yaml are on disk, the config equals the planned one but for
    the progress bar and output directory, and its cold start is kept: a redone cold start redoes every run that
    starts from it. A damaged record counts as unfinished, so its work is redone, and the command says so."""
    cold: dict[str, float] = {}
    for f, cfg in files.items():
        info, conf = f.with_suffix(".json"), f.with_suffix(".yaml")
        if not (f.is_file() and info.is_file()):
            continue  # not finished
        try:
            kept = load_config(conf)
            seconds = float(json.loads(info.read_text())["seconds"])
        except _DAMAGED as e:
            _say(f"--resume: redoing the cold start {f.name}: its record is damaged ({type(e).__name__}: {e})")
            continue
        if cold_start_key(kept) == cold_start_key(cfg):
            cold[f.name] = seconds
    runs: dict[str, dict] = {}
    for job in plan:
        wall = job.dir / "wall_time.json"
        if job.init.name not in cold or not (job.dir / "metrics.jsonl").is_file() or not wall.is_file():
            continue  # not finished, or its cold start is redone
        planned = to_dict(run_config(base, job.overrides, job.seed))
        try:
            kept = read_yaml(job.dir / "config.yaml")
            record = json.loads(wall.read_text())
            record = {**record, "seconds": float(record["seconds"])}
        except _DAMAGED as e:
            _say(f"--resume: redoing {job.label}: its record is damaged ({type(e).__name__}: {e})")
            continue
        if _comparable(kept) == _comparable(planned):
            runs[job.label] = record
    return cold, runs


def _warn_on_thread_change(kept_runs: dict[str, dict], threads: int, new: int) -> None:
    """Say so when --resume runs new runs with another thread count than the kept ones (recorded in their
    wall_time.json): CPU kernels split reductions by thread, so the two sets differ in float rounding."""
    old = {record.get("threads") for record in kept_runs.values()} - {None}
    if old and old != {threads}:
        _say(f"--resume: warning: the kept runs ran with {'/'.join(map(str, sorted(old)))} thread(s) each and the "
             f"{new} new one(s) run with {threads}, so the two sets differ in float rounding")


def _run_in_process(plan: list[Job], files: dict, base: dict) -> tuple[dict, dict]:
    """Cold starts and runs one after another in this process (also under torchrun), each seed's cold starts just
    before its runs; a run whose cold start is not in `files` (kept by --resume) starts from its weights file.
    ({weights file name: seconds}, {run label: seconds})."""
    from safetensors.torch import load_file

    cold_s: dict[str, float] = {}
    walls: dict[str, float] = {}
    states: dict[Path, dict] = {}
    seed = None
    for job in plan:
        if job.seed != seed:  # a new seed: the previous seed's weights are no longer needed
            states, seed = {}, job.seed
        if job.init not in states:
            if job.init in files:
                states[job.init], cold_s[job.init.name] = cold_start_to_file(files[job.init], job.init)
            else:  # kept by --resume
                states[job.init] = load_file(str(job.init))
        cfg = run_config(base, job.overrides, job.seed)
        walls[job.label] = train_one(cfg, job.dir, states[job.init], job.label, job.overrides)
    return cold_s, walls


def cold_start_to_file(cfg, path: Path) -> tuple[dict, float]:
    """Cold-start `cfg`, write its weights to `path` (safetensors) and the seconds taken to path.json (rank 0);
    (weights, seconds)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    _say(f"cold start (seed {cfg.train.seed}): {cfg.train.cold_start_steps} supervised steps on {cfg.rollout.task}")
    info = path.with_suffix(".json")  # written last: a cold start without it is unfinished (see reusable_work)
    if not dist.is_initialized() or dist.get_rank() == 0:
        info.unlink(missing_ok=True)
    t = time.perf_counter()
    state = cold_start_state(cfg)
    seconds = time.perf_counter() - t
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        tmp = path.with_name(path.name + ".tmp")
        save_file(state, str(tmp))
        os.replace(tmp, path)
        info.write_text(json.dumps({"seconds": seconds, "seed": cfg.train.seed}))
    return state, seconds


def train_one(cfg, run_dir: Path, init_state: dict, label: str, overrides=()) -> float:
    """One run of the loop from `init_state`, replacing any previous run in run_dir; writes wall_time.json
    (seconds of train(), excluding process start-up) and returns those seconds."""
    import torch
    import torch.distributed as dist

    from moe_gspo.train.loop import train
    from moe_gspo.train.separate import split_and_serve

    wall = Path(run_dir) / "wall_time.json"  # written last: a run without it is unfinished (see reusable_work)
    # the job's rank 0 (an engine rank of a run with separate engines has a rank 0 of its own engine world)
    first = int(os.environ.get("RANK", "0")) == 0 and (not dist.is_initialized() or dist.get_rank() == 0)
    if first:
        wall.unlink(missing_ok=True)
    t = time.perf_counter()
    roles, served = split_and_serve(cfg)  # an engine rank of a separate-placement run only samples
    if not served:
        train(cfg, run_dir=run_dir, init_state=init_state, label=label, overwrite=True, roles=roles)
    seconds = time.perf_counter() - t
    if first:
        wall.write_text(json.dumps({"seconds": seconds, "overrides": list(overrides), "seed": cfg.train.seed,
                                    "threads": torch.get_num_threads()}))
    return seconds


def run_one(config_path, run_dir, weights) -> float:
    """What `moe-gspo compare --run-one WEIGHTS --config RUN.yaml --out RUN_DIR` does in a --jobs process: train the
    plain run config RUN.yaml into RUN_DIR from the weights in WEIGHTS (safetensors)."""
    from safetensors.torch import load_file

    weights, run_dir = Path(weights), Path(run_dir)
    if not weights.is_file():
        raise UserError(f"--run-one {weights}: weights file not found")
    cfg = load_config(config_path)
    job = run_dir / "job.json"  # the variant's overrides, recorded in wall_time.json as in-process runs do
    overrides = json.loads(job.read_text()).get("overrides", []) if job.is_file() else []
    return train_one(cfg, run_dir, load_file(str(weights)), f"{run_dir.parent.name}/{run_dir.name}", overrides)


def cold_start_one(config_path, weights) -> float:
    """What `moe-gspo compare --cold-start-to WEIGHTS --config RUN.yaml` does in a --jobs process: cold-start the
    plain run config RUN.yaml and write WEIGHTS (safetensors) and WEIGHTS' .json (seconds)."""
    return cold_start_to_file(load_config(config_path), Path(weights))[1]


def _thread_budget() -> int:
    """The threads this process computes with (OMP_NUM_THREADS, else torch's default: the cores), which --jobs
    divides among its processes. A run's float results depend on its thread count (CPU kernels split reductions
    by thread), so `--jobs K` reproduces `--jobs 1` exactly when each gets the same number of threads."""
    import torch

    return torch.get_num_threads()


def _run_in_processes(plan: list[Job], files: dict, base: dict, jobs: int, threads: int) -> tuple[dict, dict]:
    """The cold starts, then the runs, `jobs` at a time, each a `moe-gspo compare` process with `threads` OpenMP
    threads, a YAML config and its weights in a safetensors file; ({weights file name: seconds}, {run: seconds})."""
    cold = []
    for f, cfg in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        y = f.with_suffix(".yaml")
        y.write_text(yaml.safe_dump(to_dict(_quiet(cfg)), sort_keys=False))
        cold.append((f"cold start {f.stem}", ["--config", str(y), "--out", str(f.parent), "--cold-start-to", str(f)],
                     f.with_suffix(".log"), f.with_suffix(".json"), f.name, 1))
    runs = []
    for job in plan:
        job.dir.mkdir(parents=True, exist_ok=True)
        cfg = _quiet(run_config(base, job.overrides, job.seed))
        (job.dir / "job.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        (job.dir / "job.json").write_text(json.dumps({"variant": job.variant, "seed": job.seed,
                                                      "overrides": list(job.overrides), "init": str(job.init)}))
        # a run with engines on ranks of their own is a torchrun job of its trainer rank and its engine ranks
        nproc = 1 + cfg.rollout.engine_ranks if cfg.rollout.placement == "separate" else 1
        runs.append((job.label, ["--config", str(job.dir / "job.yaml"), "--out", str(job.dir), "--run-one",
                                 str(job.init)], job.dir / "log.txt", job.dir / "wall_time.json", job.label, nproc))
    _say(f"{len(cold)} cold start(s), then {len(runs)} runs, {jobs} at a time with {threads} thread(s) each; "
         "logs: <run dir>/log.txt")
    return _processes(cold, jobs, threads), _processes(runs, jobs, threads)


def _quiet(cfg):
    """A config for a background process: no progress bar (its output goes to a log file)."""
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, progress=False))


def _processes(tasks: list[tuple], jobs: int, threads: int) -> dict[str, float]:
    """Run (label, compare arguments, log file, result JSON with "seconds", key, processes) tasks `jobs` at a time
    as `python -m moe_gspo.cli compare ...` processes (a torchrun job of that many ranks when more than one);
    {key: seconds}. After a failure no new task starts; the error names each failed task with the last line of its
    log (one line when all failed on user errors, exit code 2)."""
    pkg_root = str(Path(__file__).resolve().parents[2])  # the directory that holds the moe_gspo package
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
    # a torchrun job of n processes shares its run's threads among them
    job_env = {n: {**env, "OMP_NUM_THREADS": str(max(1, threads // n)), "MKL_NUM_THREADS": str(max(1, threads // n))}
               for n in {t[5] for t in tasks}}
    failed: list[tuple[int, str]] = []  # (exit code, message)

    def launch(task) -> float | None:
        label, args, log_path, result, _, nproc = task
        if failed:
            return None
        cmd = [sys.executable, "-m", "moe_gspo.cli", "compare", *args]
        if nproc > 1:
            from moe_gspo.parallel.state import free_port

            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", *cmd[1:]]
        with log_path.open("w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env[nproc]).returncode
        if rc:
            last = (log_path.read_text().strip().splitlines() or [""])[-1]
            failed.append((rc, f"{label}: {last} (exit {rc}; log: {log_path})"))
            return None
        return json.loads(result.read_text())["seconds"]

    seconds: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(launch, t): t for t in tasks}
        for fut in as_completed(futures):
            task, s = futures[fut], fut.result()
            if s is not None:
                seconds[task[4]] = s
                _say(f"[{len(seconds)}/{len(tasks)}] {task[0]}: {s:.0f} s")
    if failed:
        text = "; ".join(msg for _, msg in failed)
        if all(rc == 2 for rc, _ in failed):  # the CLI's exit code for an error the user can fix: one line
            raise ConfigError(text)
        raise RuntimeError(f"comparison runs failed: {text}")
    return {t[4]: seconds[t[4]] for t in tasks}


def _say(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank (before the process group exists)
        print(msg, file=sys.stderr, flush=True)
