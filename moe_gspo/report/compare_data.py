"""What a comparison's report states, as data: each variant's runs (DIR/<variant>/seed_<s>/metrics.jsonl), their
statistics (final reward with its 95% t-interval, the paired difference against the baseline with a verdict,
collapses; moe_gspo/report/stats.py), and the rows of the report's tables (summary, differences, runs, clipping /
volatility / mismatch, expert load, the per-layer flip split; the settings are compare_settings.py's). compare.py
writes them as HTML, summary_lines as text for the terminal.

Flip rates and routing mismatch are shown in percent everywhere. Intervals of quantities with a range they cannot
leave (rates and fractions in [0, 1], the load max/mean >= 1) are cut to it (stats.bounded).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_gspo.config import CompareConfig, UserError
from moe_gspo.report.plots import Run, load_metrics
from moe_gspo.report.stats import Interval, band, bounded, collapses, final_value, t_interval, verdict
from moe_gspo.report.volatility import LAYER, churn_counts, pooled_churn

REWARD, ACC, CLIP, CLIP_LO, FLIP = "reward/mean", "accuracy", "pg_clipfrac", "pg_clipfrac_lower", "moe/flip_rate"
MISMATCH, PDIFF, VARIANCE = "moe/rollout_train_mismatch", "rollout_probs_diff_mean", "groups/with_variance"
LOAD_RATIO, LOAD_ENTROPY = "moe/load_max_over_mean", "moe/load_entropy"  # moe_gspo/routing/tracker.py
LOAD_HEADER = ["variant", "flip rate % [95% t]", "load max/mean [95% t]", "load entropy / ln E [95% t]",
               "max/mean per layer", "entropy / ln E per layer"]
RATE = (0.0, 1.0)
"""The range of a rate or fraction (flip rate, mismatch, clip fraction, accuracy): intervals are cut to it."""
SPLIT = ("bias", "gradient")
"""The sources the tracker splits flips into: moe/flip_rate_from_<source>/layer_<i>."""


@dataclass
class Variant:
    """The runs of one variant, one per seed (seed None: a single run without a seed directory)."""

    name: str
    runs: list[Run]
    seeds: list[int | None]

    def matrix(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps (T,), values (seeds, T)) over the steps that every run logged `key` at."""
        series = [r.series(key) for r in self.runs]
        common = sorted(set.intersection(*(set(x.tolist()) for x, _ in series))) if series else []
        steps = np.array(common, dtype=float)
        rows = [y[np.searchsorted(x, steps)] for x, y in series] if len(steps) else []
        return steps, np.array(rows, dtype=float).reshape(len(series), len(steps))

    def mean_of(self, key: str, last: int | None = None) -> float | None:
        """Mean over seeds of each run's mean of `key` (over its last `last` steps when given)."""
        vals = []
        for r in self.runs:
            _, v = r.series(key)
            v = v[-last:] if last else v
            if len(v):
                vals.append(float(v.mean()))
        return float(np.mean(vals)) if vals else None


def load_variants(out: Path, names: Sequence[str], seeds: Sequence[int] | None = None) -> list[Variant]:
    """Each variant's runs: DIR/<name>/seed_<s>/ for the given seeds (else every seed_<s> found), or DIR/<name>/
    itself when it holds metrics.jsonl."""
    variants = []
    for name in names:
        d = out / name
        if seeds is not None:
            found = list(seeds)
        elif (d / "metrics.jsonl").is_file():
            variants.append(Variant(name, [Run(d, name, load_metrics(d))], [None]))
            continue
        else:
            found = sorted(int(m.group(1)) for p in d.glob("seed_*") if (m := re.fullmatch(r"seed_(\d+)", p.name)))
            if not found:
                raise UserError(f"{d}: no runs (neither metrics.jsonl nor seed_<s>/ directories)")
        runs = [Run(d / f"seed_{s}", f"{name}/seed_{s}", load_metrics(d / f"seed_{s}")) for s in found]
        variants.append(Variant(name, runs, list(found)))
    return variants


@dataclass
class Stats:
    """What the report states about one variant."""

    finals: list[float]
    """Final reward of each run (mean of its last final_window steps), in seed order."""
    final: Interval
    """Their mean over seeds with the 95% t-interval."""
    collapses: list[list]
    """Per run, the collapses of its reward curve (moe_gspo.report.stats.Collapse)."""
    diff: Interval | None = None
    """Paired difference of final rewards against the baseline (None for the baseline itself)."""
    verdict: str = ""


def variant_stats(variants: Sequence[Variant], settings: CompareConfig) -> tuple[str, dict[str, Stats]]:
    """(baseline name, {variant: Stats}); the baseline is grpo when present, else the first variant."""
    base = "grpo" if any(v.name == "grpo" for v in variants) else variants[0].name
    out = {}
    for v in variants:
        rewards = [r.series(REWARD)[1] for r in v.runs]
        finals = [final_value(y, settings.final_window) if len(y) else float("nan") for y in rewards]
        events = [collapses(y, settings.collapse_fraction, settings.collapse_patience, settings.collapse_min_peak,
                            settings.smooth_window) if len(y) else [] for y in rewards]
        out[v.name] = Stats(finals, t_interval(finals), events)
    b = next(v for v in variants if v.name == base)
    for v in variants:
        if v.name == base:
            continue
        paired = [(x, out[base].finals[b.seeds.index(s)]) for s, x in zip(v.seeds, out[v.name].finals)
                  if s in b.seeds]
        if paired:
            d = t_interval([x - y for x, y in paired])
            out[v.name].diff, out[v.name].verdict = d, verdict(v.name, base, d)
    return base, out


def summary_rows(variants: Sequence[Variant], stats: dict[str, Stats], base: str, walls: dict[str, float]
                 ) -> list[list]:
    """One row per variant, columns as in SUMMARY_HEADER."""
    base_clip = next((v.mean_of(CLIP) for v in variants if v.name == base), None)
    rows = []
    for v in variants:
        st = stats[v.name]
        clip = v.mean_of(CLIP)
        first = [r.series(REWARD)[1][0] for r in v.runs if len(r.series(REWARD)[1])]
        wall = [walls[r.label] for r in v.runs if r.label in walls]
        rows.append([v.name, len(v.runs), max((len(r.records) for r in v.runs), default=0),
                     float(np.mean(first)) if first else None, st.final.mean, _interval_cell(st.final),
                     f"{sum(bool(e) for e in st.collapses)}/{len(st.collapses)}",
                     clip, clip / base_clip if clip is not None and base_clip else None, _percent(v.mean_of(FLIP)),
                     _percent(v.mean_of(MISMATCH)), v.mean_of(PDIFF), float(sum(wall)) if wall else None])
    return rows


def _percent(x: float | None) -> float | None:
    return None if x is None else 100 * x


def _interval_cell(iv: Interval) -> str:
    """A final reward's or a paired difference's interval; a dash with the reason where it measures nothing (one
    seed, or no spread across seeds: a zero-width interval would read as certainty)."""
    return f"\u2014 ({iv.missing})" if iv.missing else f"[{iv.lo:.3g}, {iv.hi:.3g}]"


def collapse_p(stats: dict[str, Stats], name: str, base: str) -> float:
    """Fisher's exact two-sided p of variant `name`'s collapsed-run count against the baseline's."""
    from moe_gspo.report.stats import fisher_exact

    a, b = stats[name].collapses, stats[base].collapses
    return fisher_exact(sum(bool(e) for e in a), len(a), sum(bool(e) for e in b), len(b))


def diff_rows(variants: Sequence[Variant], stats: dict[str, Stats], base: str) -> list[list]:
    """One row per variant other than the baseline, columns as in DIFF_HEADER."""
    return [[v.name, stats[v.name].diff.n, stats[v.name].diff.mean, _interval_cell(stats[v.name].diff),
             stats[v.name].verdict, f"{sum(bool(e) for e in stats[v.name].collapses)}/{len(stats[v.name].collapses)} "
             f"vs {sum(bool(e) for e in stats[base].collapses)}/{len(stats[base].collapses)}, p = "
             f"{collapse_p(stats, v.name, base):.3f}"] for v in variants if stats[v.name].diff is not None]


def run_rows(variants: Sequence[Variant], stats: dict[str, Stats], walls: dict[str, float]) -> list[list]:
    """One row per run, columns as in RUN_HEADER."""
    rows = []
    for v in variants:
        st = stats[v.name]
        for i, (r, s) in enumerate(zip(v.runs, v.seeds)):
            steps, _ = r.series(REWARD)
            col = ", ".join(f"step {int(steps[c.start])}" + ("" if c.end is None else
                                                            f" (back at step {int(steps[c.end])})")
                            for c in st.collapses[i]) or "none"
            grad = gradient_steps(r)
            rows.append([v.name, "\u2014" if s is None else s, r.series(REWARD)[1][0] if len(steps) else None,
                         st.finals[i], col, "\u2014" if grad is None else f"{len(grad)}/{len(steps)}",
                         walls.get(r.label)])
    return rows


def run_mean(run: Run, key: str, only_with_gradient: bool = False) -> float | None:
    """Mean of `key` over a run's logged steps; with only_with_gradient, over the steps where some group had reward
    variance (a step without one has no gradient, so nothing to clip; runs that do not log it keep every step).
    None when no step qualifies."""
    x, y = run.series(key)
    keep = gradient_steps(run) if only_with_gradient else None
    if keep is not None and len(y):
        y = y[[s in keep for s in x.tolist()]]
    return float(y.mean()) if len(y) else None


def _cell(iv: Interval | None, digits: int = 3) -> str:
    if iv is None:
        return "\u2014"
    return f"{iv.mean:.{digits}g}" + ("" if iv.lo is None else f" [{iv.lo:.{digits}g}, {iv.hi:.{digits}g}]")


def _iv(values, bounds: tuple[float | None, float | None] | None = None) -> Interval | None:
    """The t-interval of the values that are not None (None when none is), cut to `bounds` (lo, hi) when given."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return bounded(t_interval(vals), *bounds) if bounds else t_interval(vals)


def metric_rows(variants: Sequence[Variant], base: str) -> list[list]:
    """Per variant, seed-level means with 95% t-intervals over seeds (columns as in METRIC_HEADER; flip rate and
    mismatch in percent; intervals cut to [0, 1], [0, 100] in percent). The clip fraction of a run is its mean over
    steps with gradient; its ratio to the baseline is paired by seed and averaged on the log scale (a geometric
    mean, interval exp of the t-interval of the log-ratios)."""
    b = next((v for v in variants if v.name == base), None)
    base_clip = {s: run_mean(r, CLIP, True) for r, s in zip(b.runs, b.seeds)} if b else {}
    rows = []
    for v in variants:
        clips = [run_mean(r, CLIP, True) for r in v.runs]
        logs = [math.log(c / base_clip[s]) for c, s in zip(clips, v.seeds)
                if c and base_clip.get(s) and s in base_clip]
        ratio = None
        if logs and v.name != base:
            iv = t_interval(logs)
            ratio = Interval(math.exp(iv.mean), None if iv.lo is None else math.exp(iv.lo),
                             None if iv.hi is None else math.exp(iv.hi), iv.n)
        rows.append([v.name, _cell(_iv(clips, RATE)), _cell(ratio) if v.name != base else "1",
                     _pct(_iv([run_mean(r, FLIP, True) for r in v.runs], RATE)),
                     _pct(_iv([run_mean(r, MISMATCH) for r in v.runs], RATE)),
                     _cell(_iv([run_mean(r, PDIFF) for r in v.runs], RATE))])
    return rows


def load_rows(variants: Sequence[Variant]) -> list[list]:
    """Per variant (columns as in LOAD_HEADER): the flip rate beside the expert load, each a run's mean over its
    steps with gradient, then the mean over seeds with its 95% t-interval; per MoE layer the mean over seeds of the
    same run means. Load max/mean and entropy are the tracker's: the largest expert share of a layer's routed slots
    times E (>= 1), and the entropy of the shares over ln E (in [0, 1]; 1 = balanced), averaged over layers; their
    intervals are cut to those ranges."""
    rows = []
    for v in variants:
        per_layer = []
        for key in (LOAD_RATIO, LOAD_ENTROPY):
            layers, m, _, _ = layer_profile(v, key + "/layer_", bounds=None)
            per_layer.append(" ".join(f"{x:.3f}" for x in m) if layers else "\u2014")
        rows.append([v.name, _pct(_iv([run_mean(r, FLIP, True) for r in v.runs], RATE)),
                     _cell(_iv([run_mean(r, LOAD_RATIO, True) for r in v.runs], (1.0, None))),
                     _cell(_iv([run_mean(r, LOAD_ENTROPY, True) for r in v.runs], RATE)), *per_layer])
    return rows


def identical_variants(variants: Sequence[Variant], key: str) -> list[tuple[str, str]]:
    """Pairs of variants whose `key` series are exactly equal at every seed (and non-empty)."""
    out = []
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            if a.seeds != b.seeds:
                continue
            same = True
            for ra, rb in zip(a.runs, b.runs):
                (xa, ya), (xb, yb) = ra.series(key), rb.series(key)
                same &= bool(len(ya)) and np.array_equal(xa, xb) and np.array_equal(ya, yb)
            if same:
                out.append((a.name, b.name))
    return out


def gradient_steps(run: Run) -> set[float] | None:
    """Steps where some group had reward variance (the others have no gradient: no update, no clipping, no flips);
    None when the run does not log it."""
    x, y = run.series(VARIANCE)
    return set(x[y > 0].tolist()) if len(x) else None


def layer_profile(v: Variant, prefix: str = LAYER, bounds: tuple[float, float] | None = RATE
                  ) -> tuple[list[int], np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(layers, mean, lo, hi): per MoE layer, each run's mean of `prefix`<layer> (the flip rate by default) over its
    steps with gradient, then the mean over seeds with its 95% t-band (lo/hi None for one seed), cut to `bounds`
    (default [0, 1], a rate's range; None: not cut). Layers are those every such run logged; a run without a step
    with gradient is left out."""
    per_run = []
    for r in v.runs:
        steps, ids, M = r.matrix(prefix)
        keep = gradient_steps(r)
        if keep is not None:
            M = M[:, [s in keep for s in steps.tolist()]]
        if not M.size:
            continue
        per_run.append({i: float(np.nanmean(M[j])) for j, i in enumerate(ids) if np.isfinite(M[j]).any()})
    layers = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    if not layers:
        return [], np.zeros(0), None, None
    mean, lo, hi = band(np.array([[d[i] for i in layers] for d in per_run]))
    if bounds is not None and lo is not None:
        lo, hi = np.clip(lo, *bounds), np.clip(hi, *bounds)
    return layers, mean, lo, hi


def expert_churn(v: Variant, prefix: str) -> tuple[dict[int, float], list[int]]:
    """({expert: churn}, experts left out): slots each expert gained (prefix CHURN_IN) or lost (CHURN_OUT), summed
    over the MoE layers and over every run's steps with gradient, divided by the slots it held in the old routing
    summed the same way (volatility.churn_counts, pooled_churn): each slot weighs the same, so a step where an
    expert held a handful of slots cannot dominate. Experts that held fewer than volatility.MIN_CHURN_SLOTS slots
    in all are left out."""
    return pooled_churn([churn_counts(r, prefix, gradient_steps(r)) for r in v.runs])


def flip_split_rows(variants: Sequence[Variant]) -> tuple[list[str], list[list]]:
    """(header, rows) of the per-layer flip split in percent: one row per MoE layer and a last one over all of them,
    two columns per variant that logs the split (flips from the expert-bias update, from the gradient). A cell is the
    mean over seeds of each run's mean over its steps with gradient; ([], []) when no variant logs the split."""
    cols = []
    for v in variants:
        for source in SPLIT:
            layers, mean, _, _ = layer_profile(v, f"moe/flip_rate_from_{source}/layer_")
            if layers:
                overall = _iv([run_mean(r, f"moe/flip_rate_from_{source}", True) for r in v.runs])
                cols.append((f"{v.name}: {source} %", dict(zip(layers, mean.tolist())),
                             None if overall is None else overall.mean))
    if not cols:
        return [], []
    fmt = lambda x: "\u2014" if x is None else f"{100 * x:.2f}"  # noqa: E731
    layers = sorted({i for _, by_layer, _ in cols for i in by_layer})
    rows = [[str(i), *(fmt(by_layer.get(i)) for _, by_layer, _ in cols)] for i in layers]
    rows.append(["all", *(fmt(overall) for *_, overall in cols)])
    return ["MoE layer", *(name for name, *_ in cols)], rows


SUMMARY_HEADER = ["variant", "seeds", "steps", "reward, step 1", "final reward", "95% t-interval", "collapsed runs",
                  "pg_clipfrac", "clip fraction / baseline's", "flip rate %", "engine mismatch %",
                  "|p_engine \u2212 p_train|", "wall time, s (all seeds)"]
"""The summary's columns; the note under the table says what each is (means over steps, then over seeds)."""
DIFF_HEADER = ["variant", "seeds paired", "mean difference of final reward", "95% t-interval", "verdict",
               "collapsed runs vs the baseline's, Fisher's exact p"]
RUN_HEADER = ["variant", "seed", "reward, step 1", "final reward", "collapses",
              "steps with gradient (some group with reward variance)", "wall time (s)"]
METRIC_HEADER = ["variant", "pg_clipfrac, steps with gradient [95% t]", "clip fraction / baseline's, paired [95% t]",
                 "flip rate %, steps with gradient [95% t]", "rollout-train routing mismatch % [95% t]",
                 "mean |p_engine \u2212 p_train| [95% t]"]


def run_walls(variants: Sequence[Variant], walls: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds per run label: `walls` where given, else the run directory's wall_time.json (a re-drawn report)."""
    walls = dict(walls or {})
    for v in variants:
        for r in v.runs:
            wt = r.dir / "wall_time.json"
            if r.label not in walls and wt.is_file():
                walls[r.label] = json.loads(wt.read_text())["seconds"]
    return walls


def read_meta(out: Path) -> tuple[dict, CompareConfig]:
    """(DIR/compare.json's content, {} without one; its statistics settings, CompareConfig defaults where absent)."""
    p = out / "compare.json"
    meta = json.loads(p.read_text()) if p.is_file() else {}
    known = {f for f in CompareConfig.__dataclass_fields__}
    return meta, CompareConfig(**{k: v for k, v in (meta.get("settings") or {}).items() if k in known})


def _fmt(iv: Interval | None, signed: bool = False) -> str:
    """A final reward or a paired difference with its interval; the mean alone where the interval measures nothing
    (Interval.missing; the verdict column says why)."""
    if iv is None:
        return "\u2014"
    f = "+.3f" if signed else ".3f"
    return f"{iv.mean:{f}}" + ("" if iv.missing else f" [{iv.lo:{f}}, {iv.hi:{f}}]")


def _pct(iv: Interval | None) -> str:
    if iv is None:
        return "\u2014"
    return f"{100 * iv.mean:.2f}" + ("" if iv.lo is None else f" [{100 * iv.lo:.2f}, {100 * iv.hi:.2f}]")


def summary_lines(out_dir: str | Path) -> list[str]:
    """The answer of the comparison in DIR as aligned text for the terminal: per variant (compare.json's), its final
    reward with the 95% t-interval over seeds, beside it the expert flip rate (steps with gradient) and the
    engine-vs-trainer routing mismatch in percent with their intervals (cut to [0, 100]), the paired difference
    against the baseline with its interval and verdict, and how many runs collapsed (the report's tables, in the
    same numbers)."""
    out = Path(out_dir)
    meta, settings = read_meta(out)
    variants = load_variants(out, list(meta["variants"]), meta.get("seeds"))
    base, stats = variant_stats(variants, settings)
    header = ["variant", "seeds", "final reward [95% t]", "flip rate % [95% t]", "engine mismatch % [95% t]",
              f"minus {base}, paired [95% t]", "verdict", "collapsed", "Fisher p"]
    rows = [header]
    for v in variants:
        st = stats[v.name]
        flip = _pct(_iv([run_mean(r, FLIP, True) for r in v.runs], RATE))
        mismatch = _pct(_iv([run_mean(r, MISMATCH) for r in v.runs], RATE))
        rows.append([v.name, str(len(v.runs)), _fmt(st.final), flip, mismatch,
                     "baseline" if v.name == base else _fmt(st.diff, True),
                     st.verdict or ("" if v.name == base else "no paired seeds"),
                     f"{sum(bool(e) for e in st.collapses)}/{len(st.collapses)}",
                     "" if v.name == base else f"{collapse_p(stats, v.name, base):.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


TURN_HEADER = ["variant", "turn", "sampled tokens", "tool tokens", "flip rate %", "engine mismatch %"]
TURN_METRICS = ("multiturn/response_tokens/turn_", "multiturn/tool_tokens/turn_", "moe/flip_rate/turn_",
                "moe/rollout_train_mismatch/turn_")


def turn_rows(variants) -> list[list[str]]:
    """Multi-turn episodes by assistant turn: per variant and turn, the mean over seeds of each run's mean over its
    steps of the sampled and tool tokens per episode, the flip rate and the engine's routing mismatch (percent of
    routed slots); '' where a run logged none. No rows when no run ran episodes with tools."""
    rows = []
    for v in variants:
        turns = sorted({t for r in v.runs for t in r.indexed(TURN_METRICS[0])})
        for t in turns:
            cells = []
            for i, prefix in enumerate(TURN_METRICS):
                means = [float(np.mean(y)) for r in v.runs if len(y := r.series(f"{prefix}{t}")[1])]
                scale = 100.0 if i >= 2 else 1.0
                cells.append(f"{np.mean(means) * scale:.{2 if i >= 2 else 1}f}" if means else "")
            rows.append([v.name, str(t), *cells])
    return rows
