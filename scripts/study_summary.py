"""Seed-level statistics of `moe-gspo study volatility` directories, as in docs/findings.md (granularity, precision).

    python scripts/study_summary.py granularity runs/granularity [--json per_seed.json]
    python scripts/study_summary.py volatility runs/volatility
    python scripts/study_summary.py paired runs/study_vllm [--json per_seed.json]
    python scripts/study_summary.py contrasts runs/study_routing grpo_top8-grpo_top2 gspo_top2-grpo_top2 \
        "gspo_top2-grpo_top2/gspo_top8-grpo_top8" [--json contrasts.json]
    python scripts/study_summary.py regime runs/study_offpolicy [--json per_seed.json]
    python scripts/study_summary.py export runs/study_vllm docs/results/vllm/runs
    python scripts/study_summary.py precision --bf16 runs/granularity --fp16 runs/precision_fp16 \
        --bf16-r3 runs/precision_bf16_r3 [--steps 6]
    python scripts/study_summary.py load runs/study_router_volatility
    python scripts/study_summary.py steps runs/study_router_volatility_s100 [--first 1] [--last 10]
    python scripts/study_summary.py power --effect 0.15 --m 3 [--collapse 0.5 0.1] [--sd 0.2] \
        docs/results/regime/runs docs/results/vllm/runs

volatility: a volatility study's table (one row per point of its depth, lr and minibatch sweeps), as the study's
own study_table.csv computes it, from study.json and the runs' metrics.
granularity: per expert layout and depth, the flip rate after one update (twice the step mean: the study runs 2
minibatches per rollout batch) with its 95% t-interval over seeds, by routed slot and, for runs that logged it, by
(token, layer) pair whose expert set changed, their ratio paired by run, and the set rate independent slot flips
would give (1 - (1 - p)^k); each run's last-third / first-third layer ratio, the engine mismatch, and the 16- over
4-layer ratio paired by seed (geometric mean).
steps: a compare directory's mean training reward per step over seeds, per variant, for steps --first..--last.
paired: a `moe-gspo compare` directory's variants against its baseline (grpo), per variant: the final reward with
its 95% t-interval, the paired difference with its per-comparison 95% interval, p-value and the interval widened
for the number of comparisons (Bonferroni), runs above the baseline, collapses (recovered) with Fisher's exact p
against the baseline's count, and run-level means of the engine-trainer routing mismatch and token-probability
gap. --json writes the per-seed values.
contrasts: a compare directory's pre-registered contrasts, the one multiple-comparison policy of docs/guide/training.md:
"a-b" is variant a minus variant b in final reward, paired by seed; "a-b/c-d" is (a - b) - (c - d) per seed (does a
gap change between conditions). The m contrasts named are one family: each gets its per-comparison 95% t-interval,
its p-value and its Bonferroni interval (level 1 - 0.05/m), and a verdict from the Bonferroni interval; collapse
counts of a and b with Fisher's exact two-sided p, significant below 0.05/m.
regime: a compare directory's mechanisms per variant: clip fraction (and its ratio to grpo's, paired by seed),
flip rate, engine-trainer routing mismatch and probability gap, the largest importance ratio (median over steps and
largest), the entropy of the last steps and collapses; the flip rate per layer; per seed the step-1 reward (the
cold start's strength) and the final reward. --json writes the per-seed values.
export: a compare directory's (or a volatility study's) raw data for the repository: compare.json (study.json)
and, per run, metrics.jsonl cut to the keys the summaries read (reward, accuracy, the routing and engine metrics
with the per-layer flip rates and expert load, clip fraction, largest ratio, entropy, lengths, the router's rate),
enough for `paired`, `regime`, `load`, `granularity` and `precision` to give the same tables from DEST.
power: the pre-registration's power calculation. The noise it plans with is measured on the committed compare
directories given: per directory, the standard deviation over seeds of each variant's final reward minus the
baseline's, paired by seed, and their root mean square over all those contrasts (the planning SD, unless --sd gives
one); beside it the run-to-run floor, the SD of gspo_token minus gspo (identical first steps) where both ran. Then,
for a true mean difference --effect in final reward, the paired t-test's power at the Bonferroni level 0.05/m for 8,
16, 24 and 32 seeds and the fewest seeds giving 80%; with --collapse P_A P_B, the power of Fisher's test on collapse
counts at those collapse probabilities, at the same level and seed counts.
load: a compare directory's expert load per variant beside its flip rate (the comparison report's table):
the largest expert share times E and the entropy of the shares over ln E, whole model and per layer.
precision: per condition, run-level means over steps 1..--steps of the routing mismatch and the token-probability
gap, pooled over the layouts with a routing choice (top-k < experts) and, apart, the layouts without one (top-k =
experts); then paired ratios between conditions, a run being one (point, seed) present in both.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np

from moe_gspo.report.stats import (fisher_exact, fisher_power, paired_p, paired_power, seeds_for_power, t_critical,
                                   t_interval)

FLIP, MISMATCH, PDIFF = "moe/flip_rate", "moe/rollout_train_mismatch", "rollout_probs_diff_mean"
MOVED = "moe/routing_noise_moved"  # train.routing_noise's share of moved slots
AFTER_1 = "moe/flip_rate/after_1"  # the flip rate of the forwards one optimizer update after pi_old
SET_FLIP = "moe/set_flip_rate"  # (token, layer) pairs whose expert set changed (runs from before it: absent)
POINT = re.compile(r"L(\d+)_lr[^_]+_mb(\d+)(?:_E(\d+)k(\d+))?$")


def records(run: Path, steps: int | None = None) -> list[dict]:
    f = run / "metrics.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []
    return [r for r in rows if steps is None or r.get("step", 0) <= steps]


def mean(rows: list[dict], key: str) -> float | None:
    v = [r[key] for r in rows if key in r]
    return float(np.mean(v)) if v else None


def cell(vals, scale: float = 100.0, fmt: str = ".2f") -> str:
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    if not vals:
        return "-"
    t = t_interval(vals)
    s = f"{scale * t.mean:{fmt}}"
    return s if t.lo is None else f"{s} [{scale * t.lo:{fmt}}, {scale * t.hi:{fmt}}]"


def ratio_cell(pairs) -> str:
    logs = [math.log(a / b) for a, b in pairs if a and b]
    if len(logs) < 2:
        return "-"
    t = t_interval(logs)
    return f"{math.exp(t.mean):.2f} [{math.exp(t.lo):.2f}, {math.exp(t.hi):.2f}] (n={t.n})"


def points(study: Path) -> dict[str, tuple[int, int, int]]:
    """{point name: (depth, experts, top-k)}, the layout read from study.json (the run config's for plain points)."""
    meta = json.loads((study / "study.json").read_text())
    return {p["name"]: (p["depth"], p.get("experts"), p.get("top_k")) for p in meta["points"]}


def granularity(study: Path, out_json: Path | None) -> None:
    seeds = json.loads((study / "study.json").read_text())["seeds"]
    per = {}
    for name, (depth, e, k) in points(study).items():
        rows = [records(study / name / f"seed_{s}") for s in seeds]
        vals = []
        for rs in rows:
            layers = [mean(rs, f"{FLIP}/layer_{i}") or 0.0 for i in range(depth)]
            n = depth // 3
            first = np.mean(layers[:n]) if n else 0.0
            sets = mean(rs, SET_FLIP)
            vals.append({"per_update": 2 * (mean(rs, FLIP) or 0.0), "mismatch": mean(rs, MISMATCH),
                         "sets_per_update": None if sets is None else 2 * sets,
                         "third_ratio": float(np.mean(layers[-n:]) / first) if first > 0 else None,
                         "reward": mean(rs, "reward/mean")})
        per[(e, k, depth)] = vals
    print("| experts | top-k | layers | slots flipped after one update % | sets changed after one update % | "
          "sets / slots | 1 - (1 - slots)^k % | last / first third | engine mismatch % | reward |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (e, k, d), vals in sorted(per.items()):
        col = lambda key: [v[key] for v in vals]  # noqa: E731
        sets = [v["sets_per_update"] for v in vals]
        ratio = ratio_cell([(b, a) for a, b in zip(col("per_update"), sets) if b is not None])
        independent = [1 - (1 - x) ** k for x in col("per_update")]  # sets if a token's k slots flipped independently
        print(f"| {e} | {k} | {d} | {cell(col('per_update'))} | {cell(sets)} | {ratio} | {cell(independent)} | "
              f"{cell(col('third_ratio'), 1.0)} | {cell(col('mismatch'))} | "
              f"{np.mean([x for x in col('reward') if x is not None]):.2f} |")
    depths = sorted({d for _, _, d in per})
    if len(depths) == 2:
        lo, hi = depths
        print(f"\n{hi} over {lo} layers, after-one-update rate, paired by seed (geometric mean [95% t]):")
        for e, k in sorted({(e, k) for e, k, _ in per}):
            a, b = per.get((e, k, lo)), per.get((e, k, hi))
            if a and b:
                pairs = [(y["per_update"], x["per_update"]) for x, y in zip(a, b)]
                print(f"  experts {e}, top-{k}: {ratio_cell(pairs)}")
    if out_json:
        out_json.write_text(json.dumps({f"E{e}k{k}_L{d}": v for (e, k, d), v in sorted(per.items())}, indent=1))


def volatility(study: Path) -> None:
    from moe_gspo.report.volatility_study import TABLE, point_stats, table_rows

    meta = json.loads((study / "study.json").read_text())
    print(f"{study}: flip rate %, mean over steps and seeds {meta['seeds']} (range of the seeds' own means); first and "
          "last layer, reward and groups with variance: means over the same steps")
    print("| layers | lr | minibatches | experts | top-k | flip rate % | seeds min - max % | first layer % | "
          "last layer % | reward | groups with variance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    pc = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
    for row in table_rows(point_stats(study, meta)):
        r = dict(zip(TABLE, row))
        print(f"| {r['layers']} | {r['lr']:g} | {r['minibatches']} | {r['experts']} | {r['top_k']} | "
              f"{pc(r['flip_rate'])} | {pc(r['seed_min'])} - {pc(r['seed_max'])} | {pc(r['first_layer'])} | "
              f"{pc(r['last_layer'])} | {r['reward']:.2f} | {r['groups_with_variance']:.2f} |")


def precision(conds: dict[str, Path], steps: int) -> None:
    seeds = {c: json.loads((d / "study.json").read_text())["seeds"] for c, d in conds.items()}
    pts = points(next(iter(conds.values())))
    pts = {n: v for n, v in pts.items() if all((d / n).is_dir() for d in conds.values())}  # points every study ran
    groups = {"routing choice (top-k < experts)": [n for n, (_, e, k) in pts.items() if k < e],
              "no routing choice (top-k = experts)": [n for n, (_, e, k) in pts.items() if k == e]}
    for title, names in groups.items():
        if not names:
            continue
        common = sorted(set.intersection(*(set(s) for s in seeds.values())))
        runs = {c: {(n, s): records(d / n / f"seed_{s}", steps) for n in names for s in common}
                for c, d in conds.items()}
        print(f"== {title}: {len(names)} points x seeds {common}, steps 1-{steps}")
        for c in conds:
            m = [mean(r, MISMATCH) for r in runs[c].values()]
            p = [mean(r, PDIFF) for r in runs[c].values()]
            big = [x["rollout_probs_diff_max"] for r in runs[c].values() for x in r if "rollout_probs_diff_max" in x]
            print(f"  {c:8s} routing mismatch % {cell(m, 100, '.3f')}   mean |p gap| {cell(p, 1, '.3g')}   largest "
                  f"|p gap| of a token {max(big, default=float('nan')):.3g}")
        first = next(iter(conds))
        for c in list(conds)[1:]:
            for key in (MISMATCH, PDIFF):
                pairs = [(mean(runs[c][r], key), mean(runs[first][r], key)) for r in runs[first]]
                pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
                scale, fmt = (100, ".3f") if key == MISMATCH else (1, ".5f")
                print(f"  {c} - {first}, {key}: {cell([a - b for a, b in pairs], scale, fmt)} (n={len(pairs)}); "
                      f"ratio {ratio_cell(pairs)} (runs where both are > 0)")


def paired(out: Path, out_json: Path | None) -> None:
    from moe_gspo.report.compare_data import load_variants, read_meta, run_mean, variant_stats

    meta, settings = read_meta(out)
    names = [n for n in meta.get("variants", []) if (out / n).is_dir()]
    variants = load_variants(out, names)
    base, stats = variant_stats(variants, settings)
    m = len(variants) - 1  # comparisons against the baseline
    b = next(v for v in variants if v.name == base)
    collapsed = lambda st: sum(bool(e) for e in st.collapses)  # noqa: E731
    recovered = lambda st: sum(bool(e) and all(c.end is not None for c in e) for e in st.collapses)  # noqa: E731
    print(f"{out}: baseline {base}; {m} comparisons, Bonferroni level 1 - 0.05/{m}; final reward = mean of the last "
          f"{settings.final_window} steps; seeds {b.seeds}")
    print("| variant | final reward | minus " + base + ", paired | p | Bonferroni interval | above (seeds) | "
          "collapsed (recovered) | Fisher p vs " + base + " | engine mismatch % | token-probability gap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    per_seed = {}
    for v in variants:
        st = stats[v.name]
        mism = [run_mean(r, MISMATCH) for r in v.runs]
        gap = [run_mean(r, PDIFF) for r in v.runs]
        per_seed[v.name] = {"seeds": v.seeds, "final": st.finals, "mismatch": mism, "probs_diff": gap,
                            "collapsed": [bool(e) for e in st.collapses]}
        row = [v.name, st.final.text(3)]
        if v.name == base:
            row += ["", "", "", "", f"{collapsed(st)}/{len(v.runs)} ({recovered(st)})", ""]
        else:
            diffs = [x - stats[base].finals[b.seeds.index(s_)] for s_, x in zip(v.seeds, st.finals) if s_ in b.seeds]
            d, p = st.diff, paired_p(diffs)
            half = t_critical(len(diffs) - 1, 1 - 0.05 / m) * float(np.std(diffs, ddof=1)) / math.sqrt(len(diffs))
            row += [f"{d.mean:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]", "-" if p is None else f"{p:.3f}",
                    f"[{d.mean - half:+.3f}, {d.mean + half:+.3f}]", str(sum(x > 0 for x in diffs)),
                    f"{collapsed(st)}/{len(v.runs)} ({recovered(st)})",
                    f"{fisher_exact(collapsed(st), len(v.runs), collapsed(stats[base]), len(b.runs)):.3f}"]
        row += [cell(mism), cell(gap, 1.0, ".5f")]
        print("| " + " | ".join(row) + " |")
    if out_json:
        out_json.write_text(json.dumps(per_seed, indent=1))


def contrasts(out: Path, specs: list[str], out_json: Path | None) -> None:
    from moe_gspo.report.compare_data import load_variants, read_meta, variant_stats

    meta, settings = read_meta(out)
    names = [n for n in meta.get("variants", []) if (out / n).is_dir()]
    variants = {v.name: v for v in load_variants(out, names)}
    _, stats = variant_stats(list(variants.values()), settings)
    finals = {n: dict(zip(v.seeds, stats[n].finals)) for n, v in variants.items()}
    collapsed = {n: sum(bool(e) for e in stats[n].collapses) for n in variants}

    def diff(spec: str) -> dict:
        a, b = spec.split("-")
        if a not in finals or b not in finals:
            raise SystemExit(f"contrast {spec!r}: variants are {', '.join(finals)}")
        return {s_: finals[a][s_] - finals[b][s_] for s_ in finals[a] if s_ in finals[b]}

    m = len(specs)
    print(f"{out}: {m} contrasts, one family: Bonferroni level 1 - 0.05/{m}; final reward = mean of the last "
          f"{settings.final_window} steps; Fisher's exact p on collapse counts, significant below {0.05 / m:.4f}")
    print("| contrast | seeds | mean difference [95% t] | p | Bonferroni interval | verdict | collapsed | Fisher p |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for spec in specs:
        parts = spec.split("/")
        d = diff(parts[0])
        if len(parts) == 2:
            d2 = diff(parts[1])
            d = {s_: x - d2[s_] for s_, x in d.items() if s_ in d2}
        vals = [d[s_] for s_ in sorted(d)]
        n = len(vals)
        mu, sd = float(np.mean(vals)), float(np.std(vals, ddof=1))
        half = t_critical(n - 1, 0.95) * sd / math.sqrt(n)
        bhalf = t_critical(n - 1, 1 - 0.05 / m) * sd / math.sqrt(n)
        p = paired_p(vals)
        verdict = ("above 0" if mu - bhalf > 0 else "below 0" if mu + bhalf < 0 else "not distinguishable")
        coll, fp = "", ""
        if len(parts) == 1:
            a, b = parts[0].split("-")
            coll = f"{collapsed[a]}/{len(finals[a])} vs {collapsed[b]}/{len(finals[b])}"
            fp = f"{fisher_exact(collapsed[a], len(finals[a]), collapsed[b], len(finals[b])):.3f}"
        print(f"| {spec} | {n} | {mu:+.3f} [{mu - half:+.3f}, {mu + half:+.3f}] | {'-' if p is None else f'{p:.3f}'} | "
              f"[{mu - bhalf:+.3f}, {mu + bhalf:+.3f}] | {verdict} | {coll} | {fp} |")
        rows[spec] = {"per_seed": {str(k): v for k, v in sorted(d.items())}, "mean": mu, "ci95": [mu - half, mu + half],
                      "bonferroni": [mu - bhalf, mu + bhalf], "p": p, "verdict": verdict}
    if out_json:
        out_json.write_text(json.dumps({"family_size": m, "contrasts": rows, "collapsed": collapsed,
                                        "finals": {n: {str(k): v for k, v in f.items()} for n, f in finals.items()}},
                                       indent=1))


def regime(out: Path, out_json: Path | None, baseline: str | None = None) -> None:
    from moe_gspo.report.compare_data import (CLIP, gradient_steps, layer_profile, load_variants, metric_rows,
                                              read_meta, run_mean, variant_stats)

    meta, settings = read_meta(out)
    names = [n for n in meta.get("variants", []) if (out / n).is_dir()]
    variants = load_variants(out, names)
    base, stats = variant_stats(variants, settings)
    base = baseline or base
    if base not in names:
        raise SystemExit(f"--base {base!r}: variants are {', '.join(names)}")
    print(f"{out}: per variant, seed-level means over each run's steps with gradient (some group with reward "
          f"variance), 95% t over seeds; the ratio columns are paired with {base} by seed (geometric mean)")
    print("| variant | clip fraction % | clip fraction / " + base + " | flip rate % | engine routing mismatch % | "
          "mean abs p gap | ratio_max: median over steps | ratio_max: largest | entropy, last 10 steps | collapsed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    per = {}
    for v, row in zip(variants, metric_rows(variants, base)):
        rmax = [r.series("ratio_max")[1] for r in v.runs]  # finite values only (Run.series)
        keep = [gradient_steps(r) for r in v.runs]
        ent = [mean(r.records[-settings.final_window:], "entropy") for r in v.runs]
        allr = np.concatenate(rmax) if rmax else np.zeros(0)
        st = stats[v.name]
        nc = sum(bool(e) for e in st.collapses)
        per[v.name] = {"seeds": v.seeds, "final": st.finals, "step1_reward": [float(r.series("reward/mean")[1][0])
                                                                          for r in v.runs],
                       "clipfrac": [run_mean(r, CLIP, True) for r in v.runs],
                       "flip_rate": [run_mean(r, FLIP, True) for r in v.runs],
                       "mismatch": [run_mean(r, MISMATCH) for r in v.runs],
                       "probs_diff": [run_mean(r, PDIFF) for r in v.runs],
                       "ratio_max": [float(y.max()) if len(y) else None for y in rmax],
                       "entropy_last": ent, "collapsed": [bool(e) for e in st.collapses],
                       "collapse_start": [e[0].start if e else None for e in st.collapses],
                       "steps_with_gradient": [None if k is None else len(k) for k in keep]}
        if any(AFTER_1 in rec for r in v.runs for rec in r.records):
            per[v.name]["flip_after_1"] = [run_mean(r, AFTER_1, True) for r in v.runs]
        if any(MOVED in rec for r in v.runs for rec in r.records):
            per[v.name]["noise_moved"] = [run_mean(r, MOVED, True) for r in v.runs]
        print(f"| {v.name} | {cell(per[v.name]['clipfrac'])} | {row[2]} | {cell(per[v.name]['flip_rate'])} | "
              f"{cell(per[v.name]['mismatch'])} | {cell(per[v.name]['probs_diff'], 1.0, '.5f')} | "
              f"{np.median(allr) if len(allr) else float('nan'):.3g} | {allr.max() if len(allr) else float('nan'):.3g} | "
              f"{cell(ent, 1.0, '.3f')} | {nc}/{len(v.runs)} |")
    per_update = [v.name for v in variants if "flip_after_1" in per[v.name]]
    if per_update:
        print("\nFlip rate per update (the minibatch one optimizer update after pi_old), %: "
              + ", ".join(f"{n} {cell(per[n]['flip_after_1'])}" for n in per_update))
    noisy = [v.name for v in variants if "noise_moved" in per[v.name]]
    if noisy:
        print("\nRouting noise (train.routing_noise): slots moved, and the disagreement of pi_theta's routing with "
              "pi_old's (flip rate + moved), % (each run's mean over its steps with gradient, 95% t over seeds):")
        for n in noisy:
            moved, flips = per[n]["noise_moved"], per[n]["flip_rate"]
            both = [a + b for a, b in zip(moved, flips) if a is not None and b is not None]
            print(f"  {n:12s} moved {cell(moved)}  disagreement {cell(both)}")
    print("\nFlip rate per MoE layer, % (each run's mean over its steps with gradient, then the mean over seeds):")
    for v in variants:
        layers, m, _, _ = layer_profile(v)
        if layers:
            print(f"  {v.name:12s} " + " ".join(f"{100 * x:.2f}" for x in m))
    print("\nPer seed: step-1 reward (the cold start's strength) and final reward; c marks a collapse:")
    for v in variants:
        p = per[v.name]
        print(f"  {v.name:12s} " + "  ".join(f"s{s}: {a:.2f}->{f:.2f}{'c' if c else ''}" for s, a, f, c in
                                            zip(p["seeds"], p["step1_reward"], p["final"], p["collapsed"])))
    if out_json:
        out_json.write_text(json.dumps(per, indent=1))


def collapse_rules(out: Path) -> None:
    """Collapse counts per variant by the rule in force and with peaks from full smoothing windows only."""
    from moe_gspo.report.compare_data import REWARD, load_variants, read_meta
    from moe_gspo.report.stats import collapses

    meta, s = read_meta(out)
    variants = load_variants(out, [n for n in meta.get("variants", []) if (out / n).is_dir()])
    print(f"{out}: collapses ({s.smooth_window}-step trailing mean below {s.collapse_fraction:g} of its peak for "
          f"{s.collapse_patience} steps or to the end; peak >= {s.collapse_min_peak:g})")
    print("| variant | rule in force (peak from step 1 on) | peaks from full windows only |")
    print("| --- | --- | --- |")
    for v in variants:
        counts = []
        for full in (False, True):
            hit = [bool(collapses(r.series(REWARD)[1], s.collapse_fraction, s.collapse_patience, s.collapse_min_peak,
                                  s.smooth_window, full_windows=full)) for r in v.runs]
            counts.append(f"{sum(hit)}/{len(hit)} (seeds {', '.join(str(x) for x, h in zip(v.seeds, hit) if h)})")
        print(f"| {v.name} | {counts[0]} | {counts[1]} |")


def paired_sds(out: Path) -> tuple[dict[str, float], float | None]:
    """({variant: SD over seeds of its final reward minus the baseline's}, SD of gspo_token - gspo or None)."""
    from moe_gspo.report.compare_data import load_variants, read_meta, variant_stats

    meta, settings = read_meta(out)
    variants = load_variants(out, [n for n in meta.get("variants", []) if (out / n).is_dir()])
    base, stats = variant_stats(variants, settings)
    finals = {v.name: dict(zip(v.seeds, stats[v.name].finals)) for v in variants}

    def sd(a: str, b: str) -> float:
        return float(np.std([finals[a][s_] - finals[b][s_] for s_ in finals[a] if s_ in finals[b]], ddof=1))

    floor = sd("gspo_token", "gspo") if {"gspo", "gspo_token"} <= finals.keys() else None
    return {n: sd(n, base) for n in finals if n != base}, floor


def load(out: Path) -> None:
    from moe_gspo.report.compare_data import LOAD_HEADER, load_rows, load_variants, read_meta

    meta, _ = read_meta(out)
    variants = load_variants(out, [n for n in meta.get("variants", []) if (out / n).is_dir()])
    print(f"{out}: per variant, each run's mean over its steps with gradient, 95% t over seeds; per layer: the mean "
          "over seeds (layer 0 first)")
    print("| " + " | ".join(LOAD_HEADER) + " |")
    print("|" + " --- |" * len(LOAD_HEADER))
    for row in load_rows(variants):
        print("| " + " | ".join(row) + " |")


def power(dirs: list[Path], effect: float, m: int, sd: float | None, collapse: list[float] | None) -> None:
    alpha = 0.05 / m
    all_sds = []
    for d in dirs:
        sds, floor = paired_sds(d)
        all_sds += list(sds.values())
        print(f"{d}: SD of the paired difference of final rewards, per variant minus the baseline: "
              + ", ".join(f"{n} {v:.3f}" for n, v in sds.items())
              + ("" if floor is None else f"; run-to-run floor (gspo_token - gspo) {floor:.3f}"))
    measured = float(np.sqrt(np.mean(np.square(all_sds)))) if all_sds else None
    if measured is not None:
        print(f"root mean square over {len(all_sds)} contrasts: {measured:.3f}")
    plan = sd if sd is not None else measured
    if plan is None:
        raise SystemExit("power: give --sd or at least one compare directory")
    ns = (8, 16, 24, 32)
    print(f"planning SD {plan:.3f}{' (--sd)' if sd is not None else ''}; effect {effect:+.3f} in final reward; "
          f"m = {m}, two-sided paired t at alpha = 0.05/{m} = {alpha:.4f}")
    print("  power at " + ", ".join(f"{n} seeds {paired_power(effect, plan, n, alpha):.2f}" for n in ns)
          + f"; 80% needs {seeds_for_power(effect, plan, alpha)} seeds")
    if collapse:
        a, b = collapse
        print(f"  Fisher's test on collapse counts, probabilities {a:g} against {b:g}: power at "
              + ", ".join(f"{n} seeds {fisher_power(a, b, n, alpha):.2f}" for n in ns))


EXPORT_KEYS = ("step", "reward/mean", "accuracy", "groups/with_variance", "response_length/mean", FLIP, MISMATCH,
               PDIFF, "rollout_probs_diff_max", "pg_clipfrac", "ppo_kl", "grad_norm", "ratio_max", "entropy",
               "moe/flip_tokens", "router_lr", "moe/load_max_over_mean", "moe/load_entropy", MOVED)
EXPORT_PREFIXES = (FLIP + "/layer_", FLIP + "/after_", SET_FLIP, "moe/load/layer_", "moe/load_max_over_mean/layer_",
                   "moe/load_entropy/layer_")


def steps(out: Path, first: int, last: int) -> None:
    variants = sorted(d.name for d in out.iterdir() if d.is_dir() and any(d.glob("seed_*/metrics.jsonl")))
    print("| variant | seeds | " + " | ".join(f"step {s}" for s in range(first, last + 1)) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in range(first, last + 1)) + " |")
    for v in variants:
        runs = [records(r) for r in sorted((out / v).glob("seed_*"))]
        by_step = {s: [r["reward/mean"] for rs in runs for r in rs if r.get("step") == s and "reward/mean" in r]
                   for s in range(first, last + 1)}
        print(f"| {v} | {len(runs)} | " + " | ".join(f"{np.mean(x):.3f}" if x else "-" for x in by_step.values())
              + " |")


def export(out: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for meta in ("compare.json", "study.json", "study_table.csv"):  # a comparison's or a volatility study's
        if (out / meta).is_file():
            (dest / meta).write_text((out / meta).read_text())
    n = 0
    for f in sorted(out.glob("*/seed_*/metrics.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        target = dest / f.relative_to(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(json.dumps({k: v for k, v in r.items() if k in EXPORT_KEYS or
                                              k.startswith(EXPORT_PREFIXES)}) + "\n" for r in rows))
        n += 1
    print(f"{n} runs -> {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("granularity")
    g.add_argument("study", type=Path)
    g.add_argument("--json", type=Path)
    pr = sub.add_parser("paired")
    pr.add_argument("compare_dir", type=Path)
    pr.add_argument("--json", type=Path)
    co = sub.add_parser("contrasts")
    co.add_argument("compare_dir", type=Path)
    co.add_argument("specs", nargs="+", help='"a-b" or "a-b/c-d" (variant names)')
    co.add_argument("--json", type=Path)
    vo = sub.add_parser("volatility")
    vo.add_argument("study", type=Path)
    rg = sub.add_parser("regime")
    rg.add_argument("compare_dir", type=Path)
    rg.add_argument("--json", type=Path)
    rg.add_argument("--base", help="the variant the clip-fraction ratios are paired with (default: grpo)")
    ex = sub.add_parser("export")
    ex.add_argument("compare_dir", type=Path)
    ex.add_argument("dest", type=Path)
    cr = sub.add_parser("collapse_rules")
    cr.add_argument("out", type=Path)
    ld = sub.add_parser("load")
    ld.add_argument("compare_dir", type=Path)
    st = sub.add_parser("steps")
    st.add_argument("compare_dir", type=Path)
    st.add_argument("--first", type=int, default=1)
    st.add_argument("--last", type=int, default=10)
    pw = sub.add_parser("power")
    pw.add_argument("compare_dirs", type=Path, nargs="*", help="committed compare directories to measure the SD on")
    pw.add_argument("--effect", type=float, required=True, help="the true mean difference in final reward to detect")
    pw.add_argument("--m", type=int, default=1, help="contrasts in the family (Bonferroni level 0.05/m)")
    pw.add_argument("--sd", type=float, help="plan with this SD of the paired difference instead of the measured")
    pw.add_argument("--collapse", type=float, nargs=2, metavar=("P_A", "P_B"),
                    help="collapse probabilities of the two arms, for Fisher's test's power")
    p = sub.add_parser("precision")
    for name in ("bf16", "fp16", "bf16-r3", "fp16-r3", "fp32"):
        p.add_argument(f"--{name}", type=Path, help="a study directory with that engine (first given: the reference)")
    p.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.what == "granularity":
        granularity(a.study, a.json)
    elif a.what == "paired":
        paired(a.compare_dir, a.json)
    elif a.what == "contrasts":
        contrasts(a.compare_dir, a.specs, a.json)
    elif a.what == "volatility":
        volatility(a.study)
    elif a.what == "regime":
        regime(a.compare_dir, a.json, a.base)
    elif a.what == "collapse_rules":
        collapse_rules(a.out)
    elif a.what == "load":
        load(a.compare_dir)
    elif a.what == "power":
        power(a.compare_dirs, a.effect, a.m, a.sd, a.collapse)
    elif a.what == "steps":
        steps(a.compare_dir, a.first, a.last)
    elif a.what == "export":
        export(a.compare_dir, a.dest)
    else:
        conds = {n: d for n in ("bf16", "fp16", "bf16_r3", "fp16_r3", "fp32") if (d := getattr(a, n))}
        precision(conds, a.steps)


if __name__ == "__main__":
    main()
