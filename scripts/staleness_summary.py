"""The staleness study's tables (docs/findings.md, "Staleness"), from a `moe-gspo compare` directory of
configs/studies/staleness_cpu.yaml or its committed raw data.

    python scripts/staleness_summary.py runs/study_staleness [--export docs/results/staleness/runs]

Prints, per variant: the final reward (mean of the last compare.final_window steps) with its 95% t-interval over
seeds, collapses (the comparison's rule), and run means over steps of the version lag, the engine-trainer log-prob
gap (rollout_logprobs_diff_max) and, with TIS, the largest importance weight (rollout_corr/is_max), the truncated
fraction and the effective sample size. Then the pre-registered family (m = 3: each algorithm at k = 2 minus k = 0,
paired by seed) with per-comparison and Bonferroni intervals, and the secondary contrasts (k = 1 minus k = 0, GRPO +
TIS minus GRPO at k = 2). --export writes each run's metrics cut to those keys, and compare.json, for the repository.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_gspo.report.stats import collapses, final_value, paired_p, t_interval  # noqa: E402

ALGOS = ("grpo", "grpo_tis", "gspo")
KS = (0, 1, 2)
KEYS = ("step", "reward/mean", "accuracy", "response_length/mean", "rollout_logprobs_diff_max",
        "rollout_logprobs_diff_mean", "async/version_lag", "async/version_lag_max", "async/engine_version",
        "rollout_corr/is_max", "rollout_corr/is_mean", "rollout_corr/is_min", "rollout_corr/is_ess",
        "rollout_corr/is_truncated_frac", "pg_clipfrac", "ppo_kl", "ratio_max", "entropy", "grad_norm",
        "moe/flip_rate", "engine/idle_fraction")


def load(out: Path) -> tuple[dict, dict[str, dict[int, list[dict]]]]:
    meta = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    runs: dict[str, dict[int, list[dict]]] = {}
    for a in ALGOS:
        for k in KS:
            name = f"{a}_k{k}"
            for d in sorted((out / name).glob("seed_*")):
                if not (d / "metrics.jsonl").is_file() or (d / "log.txt").is_file() and not (d / "wall_time.json").is_file():
                    continue  # a run of a comparison still running
                rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
                runs.setdefault(name, {})[int(d.name.split("_")[1])] = rows
    return meta, runs


def run_mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def fmt(iv) -> str:
    return f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]" if iv.lo is not None else f"{iv.mean:+.3f}"


def pfmt(p: float | None) -> str:
    return "-" if p is None else f"{p:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--export", type=Path, default=None)
    args = ap.parse_args()
    meta, runs = load(args.out)
    st = meta.get("settings", {})
    window, smooth = st.get("final_window", 10), st.get("smooth_window", 5)
    final = {v: {s: final_value([r["reward/mean"] for r in rows], window) for s, rows in per.items()}
             for v, per in runs.items()}
    print("| variant | seeds | final reward [95% t] | collapsed | version lag | log-prob gap max | is_max | "
          "is_truncated | is_ess |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for v, per in runs.items():
        iv = t_interval(list(final[v].values()))
        coll = sum(bool(collapses([r["reward/mean"] for r in rows], st.get("collapse_fraction", 0.5),
                                  st.get("collapse_patience", 10), st.get("collapse_min_peak", 0.1), smooth))
                   for rows in per.values())  # runs with at least one collapse
        cells = []
        for key in ("async/version_lag", "rollout_logprobs_diff_max", "rollout_corr/is_max",
                    "rollout_corr/is_truncated_frac", "rollout_corr/is_ess"):
            m = [run_mean(rows, key) for rows in per.values()]
            cells.append("-" if None in m else f"{statistics.fmean(m):.4g}")
        print(f"| {v} | {len(per)} | {fmt(iv)} | {coll}/{len(per)} | " + " | ".join(cells) + " |")

    def contrast(a: str, b: str, level: float):
        seeds = sorted(set(final[a]) & set(final[b]))
        diffs = [final[a][s] - final[b][s] for s in seeds]
        return t_interval(diffs), t_interval(diffs, level), paired_p(diffs), len(seeds)

    m = 3
    print(f"\nprimary (m = {m}, Bonferroni level {1 - 0.05 / m:.4f}): k = 2 minus k = 0, paired by seed")
    print("| contrast | n | difference [95%] | Bonferroni interval | p | verdict |")
    print("| --- | --- | --- | --- | --- | --- |")
    for a in ALGOS:
        iv, bonf, p, n = contrast(f"{a}_k2", f"{a}_k0", 1 - 0.05 / m)
        verdict = "distinguishable" if bonf.lo is not None and (bonf.lo > 0 or bonf.hi < 0) else \
            "not distinguishable"
        print(f"| {a}_k2 - {a}_k0 | {n} | {fmt(iv)} | {fmt(bonf)} | {pfmt(p)} | {verdict} |")
    print("\nsecondary (per-comparison 95%, no family correction)")
    print("| contrast | n | difference [95%] | p |")
    print("| --- | --- | --- | --- |")
    for a, b in [(f"{x}_k1", f"{x}_k0") for x in ALGOS] + [("grpo_tis_k2", "grpo_k2"), ("gspo_k2", "grpo_k2")]:
        iv, _, p, n = contrast(a, b, 0.95)
        print(f"| {a} - {b} | {n} | {fmt(iv)} | {pfmt(p)} |")
    if args.export:
        args.export.mkdir(parents=True, exist_ok=True)
        (args.export / "compare.json").write_text(json.dumps(meta, indent=1))
        for v, per in runs.items():
            for s, rows in per.items():
                d = args.export / v / f"seed_{s}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "metrics.jsonl").write_text("".join(json.dumps({k: r[k] for k in KEYS if k in r}) + "\n"
                                                         for r in rows))
        print(f"\nexported {sum(len(p) for p in runs.values())} runs -> {args.export}")


if __name__ == "__main__":
    main()
