"""Benchmark of engines on ranks of their own (rollout.placement=separate) against the colocated synchronous step,
on the same cores: the RL step, its phases, and who waits on whom.

    python scripts/bench_async.py --json runs/bench_async.json [--size gen_wide] [--steps 8] [--warmup 2]
        [--engine vllm] [--engine-dtype bfloat16] [--cores 2] [--only colocated_1x2,separate_k1] [--set a.b=v ...]

Every arm trains the same config (scripts/_rl_bench's sizes; gen_wide by default: the embedded default 4x wider,
160-token responses, where generation and training each take a large share of the step) from the same random
weights (no cold start) with the same engine, on --cores cores in all:
- colocated_1x{cores}: one process, one rank, {cores} threads: generate, then train (today's default);
- colocated_{cores}x1: torchrun, {cores} data-parallel ranks of one thread, each sampling its share;
- separate_k0 / separate_k1 / separate_k2: torchrun, {cores - 1} trainer ranks and one engine rank of one thread
  each, train.max_staleness 0 (synchronous), 1 and 2 (the engine samples batch t+1 while the trainer trains t).
Per arm, over the steps after --warmup: the median step time and tokens/s; the median of each phase (rollout is,
for separate arms, the trainer waiting for its batch; sync is the weight push, waiting for the engine included);
the trainer's idle fraction (waiting for a batch or for the engine to take a push, over the step) and the engine
rank's (waiting for a version it needs, over its cycle). The speed-up of each arm is its step time against the
fastest colocated arm measured in the same run. Prints a table and writes the rows as JSON. Run it on quiet cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from _rl_bench.comparison import BENCH_OVERRIDES, SIZES  # noqa: E402
from moe_gspo.parallel.state import free_port  # noqa: E402

PHASES = ("time/rollout", "time/logprob", "time/train", "time/sync")


def arms(cores: int) -> dict[str, tuple[int, int, list[str]]]:
    """arm -> (processes, threads per process, overrides)."""
    sep = ["rollout.placement=separate", "rollout.engine_ranks=1"]
    return {f"colocated_1x{cores}": (1, cores, []),
            f"colocated_{cores}x1": (cores, 1, []),
            "separate_k0": (cores, 1, sep + ["train.max_staleness=0"]),
            "separate_k1": (cores, 1, sep + ["train.max_staleness=1"]),
            "separate_k2": (cores, 1, sep + ["train.max_staleness=2"])}


def run_arm(name: str, nproc: int, threads: int, overrides: list[str], config: Path, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    train = ["-m", "moe_gspo.cli", "train", "--config", str(config), *overrides, f"train.out_dir={out}"]
    if nproc == 1:
        cmd = [sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *train]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-4000:]}")
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(name: str, recs: list[dict], warmup: int) -> dict:
    rs = recs[warmup:]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rs)  # noqa: E731
    step = med("time/step")
    row = {"arm": name, "steps": len(rs), "step_s": step, "tokens_per_s": med("perf/tokens_per_s"),
           **{k.split("/")[1] + "_s": med(k) for k in PHASES}}
    if "async/version_lag" in rs[0]:
        row["trainer_idle"] = statistics.median((r["trainer/wait_batch_s"] + r["trainer/wait_push_s"])
                                                / r["time/step"] for r in rs)
        row["engine_idle"] = med("engine/idle_fraction")
        row["engine_gen_s"] = med("engine/gen_s")
        row["version_lag"] = med("async/version_lag")
    row["reward_mean"] = statistics.fmean(r["reward/mean"] for r in rs)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--size", default="gen_wide", choices=[s for s in SIZES if not s.startswith("gpu")])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--engine-dtype", default="bfloat16")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated arms (default: all)")
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="overrides for every arm")
    args = ap.parse_args()
    config, size_overrides = SIZES[args.size]
    common = [*BENCH_OVERRIDES, *size_overrides, f"rollout.engine={args.engine}",
              f"rollout.engine_dtype={args.engine_dtype}", f"train.steps={args.steps}", *args.set]
    todo = arms(args.cores)
    if args.only:
        todo = {k: todo[k] for k in args.only.split(",")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        import yaml

        run_cfg = {k: v for k, v in yaml.safe_load(Path(config).read_text()).items()
                   if k not in ("compare", "variants")}  # a comparison's file: its run sections only
        config = Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump(run_cfg))
        for name, (nproc, threads, ov) in todo.items():
            rows.append(summarize(name, run_arm(name, nproc, threads, common + ov, config, Path(tmp) / name),
                                  args.warmup))
    base = min((r for r in rows if r["arm"].startswith("colocated")), key=lambda r: r["step_s"], default=None)
    for r in rows:
        r["speedup_vs_best_colocated"] = base["step_s"] / r["step_s"] if base else None
    cols = ["arm", "step_s", "tokens_per_s", "rollout_s", "logprob_s", "train_s", "sync_s", "trainer_idle",
            "engine_idle", "engine_gen_s", "version_lag", "speedup_vs_best_colocated"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    meta = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "engine": args.engine,
            "engine_dtype": args.engine_dtype, "cores": args.cores, "overrides": common,
            "date": time.strftime("%Y-%m-%d"), "cpu": _cpu()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
