"""Keep docs/results/gpu_summary.json current: one key per goal of the GPU work, each from the newest GPU run that
measured it, with that run's device, date and commit.

    python scripts/gpu_summary.py OUT_DIR [OUT_DIR ...] [--summary docs/results/gpu_summary.json]
                                  [--date YYYY-MM-DD] [--commit C] [--device NAME] [--step-metrics FILE]

scripts/gpu_check.sh runs it on its output directory at the end. Several directories count as one run (a lease
split into calls). What each key holds, and the file it comes from:

    cuda_tests               {passed, failed, skipped}: junit.xml of the tests stage
    train_phase_fraction     {gpu_single, gpu_2b}: the RL step's training tokens/s (bench_rl_<size>.json, the
                             moe-gspo row) over the isolated forward+backward's (bench_step_<size>.json, the
                             default policy's row) at the same size; goal >= 0.8
    fwd_bwd_vs_transformers  {gpu_single, gpu_2b}: bench_step_<size>.json, the default policy's speedup over
                             transformers; goal >= 1.5
    gpu_single_step_s        the median RL step of configs/gpu_single.yaml at its own parameter dtype (the configstep
                             stage's train_<dtype>/ run, or --step-metrics), the first step left out; goal <= 0.5
    rl_step_vs_trl           {gpu_single, gpu_2b}: bench_rl_<size>.json, moe-gspo's speedup over the faster TRL side

A measured value is {"value", "device", "date", "commit", "source"}; what this run does not measure keeps the
value of an earlier run, and a goal no run has measured is null. The file's top-level device, date and commit are
the newest run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("gpu_single", "gpu_2b")
DEFAULT_ROW = "moe-gspo (megatron-core, SDPA)"  # bench_step's row of the policy as configured
KEYS = {"cuda_tests": None, "train_phase_fraction": SIZES, "fwd_bwd_vs_transformers": SIZES,
        "gpu_single_step_s": None, "rl_step_vs_trl": SIZES}
DTYPE_NAMES = {"float32": ("float32", "fp32"), "bfloat16": ("bfloat16", "bf16")}


def empty() -> dict:
    """The summary before any run: every goal null."""
    return {"device": None, "date": None, "commit": None,
            **{k: (None if sizes is None else dict.fromkeys(sizes)) for k, sizes in KEYS.items()}}


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _first(dirs: list[Path], name: str) -> tuple[dict | None, Path | None]:
    for d in dirs:
        if (d / name).is_file():
            return _json(d / name), d / name
    return None, None


def tests_counts(junit: Path) -> dict[str, int]:
    """{passed, failed, skipped} of a pytest junit.xml (errors count as failed)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).iter("testcase"):
        state = "passed"
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                state = name
                break
        counts[state] += 1
    return counts


def _default_row(bench_step: dict) -> dict | None:
    return next((r for r in bench_step.get("rows", []) if r["impl"] == DEFAULT_ROW), None)


def _moe_gspo_row(bench_rl: dict, size: str) -> dict | None:
    return next((r for r in bench_rl.get("rows", []) if r["size"] == size and r["tool"] == "moe-gspo"), None)


def step_seconds(metrics: Path) -> float:
    """Median `time/step` of a run's metrics.jsonl, the first step (warm-up, CUDA graph capture) and a profiled
    step (its run directory's profile_step_N.txt) left out."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    profiled = {int(p.stem.rsplit("_", 1)[1]) for p in metrics.parent.glob("profile_step_*.txt")}
    timed = [r["time/step"] for r in rows[1:] if "time/step" in r and r.get("step") not in profiled]
    if not timed:
        raise SystemExit(f"error: {metrics}: no timed step after the first")
    return statistics.median(timed)


def config_dtype() -> str:
    """configs/gpu_single.yaml's model.params_dtype."""
    sys.path.insert(0, str(ROOT))
    from moe_gspo.config import read_yaml

    return read_yaml(ROOT / "configs" / "gpu_single.yaml").get("model", {}).get("params_dtype", "float32")


def measured(dirs: list[Path], step_metrics: Path | None = None) -> dict[str, tuple]:
    """{key or "key.size": (value, source path)} of what the run directories measured."""
    out: dict[str, tuple] = {}
    junit = next((d / "junit.xml" for d in dirs if (d / "junit.xml").is_file()), None)
    if junit is not None:
        out["cuda_tests"] = (tests_counts(junit), junit)
    for size in SIZES:
        step, step_path = _first(dirs, f"bench_step_{size}.json")
        rl, rl_path = _first(dirs, f"bench_rl_{size}.json")
        iso = _default_row(step) if step else None
        ours = _moe_gspo_row(rl, size) if rl else None
        if iso is not None:
            out[f"fwd_bwd_vs_transformers.{size}"] = (iso["speedup_vs_transformers"], step_path)
        if ours is not None and ours.get("speedup_vs_trl") is not None:
            out[f"rl_step_vs_trl.{size}"] = (ours["speedup_vs_trl"], rl_path)
        if iso is not None and ours is not None:
            out[f"train_phase_fraction.{size}"] = (ours["training_tokens_per_s"] / iso["tokens_per_s"],
                                                   [rl_path, step_path])
    if step_metrics is None:
        names = DTYPE_NAMES.get(config_dtype(), ())
        runs = (sorted((d / f"train_{n}").glob("**/metrics.jsonl")) for d in dirs for n in names)
        step_metrics = next((m for found in runs for m in found), None)
    if step_metrics is not None:
        out["gpu_single_step_s"] = (step_seconds(step_metrics), step_metrics)
    return out


def run_facts(dirs: list[Path], date: str | None, commit: str | None, device: str | None) -> dict:
    """device, date and commit of the run: the arguments, else what its files say (env.json, a benchmark's JSON),
    else today and the checkout's commit."""
    files = [j for d in dirs for name in ("env.json", "bench_rl_gpu_single.json", "bench_rl_gpu_2b.json",
                                          "bench_step_gpu_single.json", "bench_step_gpu_2b.json")
             if (j := _json(d / name)) is not None]
    if device is None:
        device = next((f.get("gpu") or f.get("device") for f in files if (f.get("gpu") or f.get("device", "cpu"))
                       not in (None, "cpu", "cuda")), None)
    if commit is None:
        commit = next((f["commit"] for f in files if f.get("commit")), None)
    if commit is None:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = git.stdout.strip() or None
    return {"device": device, "date": date or datetime.date.today().isoformat(), "commit": commit}


def update(summary: dict, found: dict[str, tuple], facts: dict) -> dict:
    """The summary with this run's measurements in place of older ones."""
    out = json.loads(json.dumps(summary)) if summary else empty()
    for key, sizes in KEYS.items():  # a key a newer version adds starts null
        out.setdefault(key, None if sizes is None else dict.fromkeys(sizes))
    for name, (value, source) in found.items():
        sources = source if isinstance(source, list) else [source]
        entry = {"value": value, **facts, "source": [_rel(s) for s in sources]}
        key, _, size = name.partition(".")
        if size:
            out[key][size] = entry
        else:
            out[key] = entry
    if found:
        out.update(facts)
    return out


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="gpu_check.sh output directories of one run")
    ap.add_argument("--summary", type=Path, default=ROOT / "docs" / "results" / "gpu_summary.json")
    ap.add_argument("--date", default=None, help="the run's date (default: today)")
    ap.add_argument("--commit", default=None, help="the run's commit (default: its files', else the checkout's)")
    ap.add_argument("--device", default=None, help="the GPU (default: its files')")
    ap.add_argument("--step-metrics", type=Path, default=None,
                    help="metrics.jsonl of the gpu_single run at its config (default: OUT_DIR/train_<dtype>/)")
    args = ap.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = measured(args.dirs, args.step_metrics)
    summary = _json(args.summary) or empty()
    new = update(summary, found, run_facts(args.dirs, args.date, args.commit, args.device))
    args.summary.write_text(json.dumps(new, indent=1) + "\n")
    print(f"{args.summary}: {len(found)} figure(s) from this run: {', '.join(sorted(found)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
