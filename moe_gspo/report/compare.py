"""The comparison report: DIR/report.html from the runs DIR/<variant>/seed_<s>/metrics.jsonl of `moe-gspo compare`.

    write_compare_report("runs/compare", ["grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_token"])
    moe-gspo report compare DIR                      # re-draw from existing runs

The seeds and the statistics settings (final window, smoothing, collapse rule) come from DIR/compare.json when it
is there (CompareConfig defaults otherwise; a variant directory holding metrics.jsonl itself is one run).
Statistics (moe_gspo/report/stats.py): a run's final reward is the mean of its last `final_window` steps; a
variant's is the mean over seeds with a 95% Student-t interval; each variant is compared with GRPO (or the first
variant when GRPO is absent) by the per-seed paired difference of final rewards, with its t-interval and a verdict;
collapses are counted per run. A run-settings table comes first (each variant's first run's config.yaml: model
shape, task, steps, batch, lr, minibatches, the clip range the loss actually used, replay, seeds). Figures (PNG next
to the HTML), every per-step curve drawn the same way (the mean over seeds faint, its trailing moving average bold,
legends outside the axes): reward (and accuracy only where it differs from the reward), each variant's seeds with the
95% t-band, clip fractions on a log scale, the expert flip rate per step, the flip rate per MoE layer (t-band across
seeds), per-expert churn, the first seed's layer x step heatmaps, rollout-vs-train routing mismatch and probability
difference. Reads the JSONL metrics, each run's config.yaml and compare.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_gspo.config import CompareConfig, UserError
from moe_gspo.report.stats import Interval, band, collapses, final_value, smooth, t_interval, verdict
from moe_gspo.report import html
from moe_gspo.report.plots import (DASHES, Run, _save, band_plot, colors, grouped_bars, legend_outside, load_metrics,
                                   plt)
from moe_gspo.report.volatility import CHURN_IN, CHURN_OUT, LAYER, write_volatility_report

REWARD, ACC, CLIP, CLIP_LO, FLIP = "reward/mean", "accuracy", "pg_clipfrac", "pg_clipfrac_lower", "moe/flip_rate"
MISMATCH, PDIFF, VARIANCE = "moe/rollout_train_mismatch", "rollout_probs_diff_mean", "groups/with_variance"


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
                     clip, clip / base_clip if clip is not None and base_clip else None, v.mean_of(FLIP),
                     v.mean_of(MISMATCH), v.mean_of(PDIFF), float(sum(wall)) if wall else None])
    return rows


def _interval_cell(iv: Interval) -> str:
    return "\u2014 (1 seed)" if iv.lo is None else f"[{iv.lo:.3g}, {iv.hi:.3g}]"


def diff_rows(variants: Sequence[Variant], stats: dict[str, Stats]) -> list[list]:
    """One row per variant other than the baseline, columns as in DIFF_HEADER."""
    return [[v.name, stats[v.name].diff.n, stats[v.name].diff.mean, _interval_cell(stats[v.name].diff),
             stats[v.name].verdict] for v in variants if stats[v.name].diff is not None]


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


def _iv(values) -> Interval | None:
    vals = [v for v in values if v is not None]
    return t_interval(vals) if vals else None


def metric_rows(variants: Sequence[Variant], base: str) -> list[list]:
    """Per variant, seed-level means with 95% t-intervals over seeds (columns as in METRIC_HEADER). The clip
    fraction of a run is its mean over steps with gradient; its ratio to the baseline is paired by seed and
    averaged on the log scale (a geometric mean, interval exp of the t-interval of the log-ratios)."""
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
        rows.append([v.name, _cell(_iv(clips)), _cell(ratio) if v.name != base else "1",
                     _cell(_iv([run_mean(r, FLIP, True) for r in v.runs])),
                     _cell(_iv([run_mean(r, MISMATCH) for r in v.runs])),
                     _cell(_iv([run_mean(r, PDIFF) for r in v.runs]))])
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


def curve(v: Variant, key: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, raw, smoothed): the mean over seeds of `key` at each step, and its `window`-step trailing moving
    average (equal to the mean over seeds of each run's moving average)."""
    x, Y = v.matrix(key)
    raw = Y.mean(0) if Y.size else np.zeros(0)
    return x, raw, smooth(raw, window) if len(raw) else raw


def mean_curves(path: Path, variants: Sequence[Variant], key: str, title: str, ylabel: str, window: int = 5,
                log: bool = False) -> Path:
    """One line per variant: the mean over seeds of `key` faint and its `window`-step moving average bold (the
    spread over seeds is in `seed_panels`). On a log axis, values <= 0 are gaps and the steps where the raw mean
    is 0 are counted in the legend."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i, (v, c) in enumerate(zip(variants, colors(len(variants)))):
        x, raw, smoothed = curve(v, key, window)
        if not len(x):
            continue
        ls = DASHES[i % len(DASHES)]
        n = len(v.runs)
        label = v.name + (f" (mean of {n} seeds)" if n > 1 else "")
        if log:
            zeros = int((raw <= 0).sum())
            label += f" ({zeros} steps at 0)" if zeros else ""
            raw, smoothed = np.where(raw > 0, raw, np.nan), np.where(smoothed > 0, smoothed, np.nan)
        ax.plot(x, raw, color=c, lw=0.8, alpha=0.3, ls="-")
        ax.plot(x, smoothed, color=c, lw=2.0, ls=ls, label=label)
    if log:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax)
    return _save(fig, path)


def gradient_steps(run: Run) -> set[float] | None:
    """Steps where some group had reward variance (the others have no gradient: no update, no clipping, no flips);
    None when the run does not log it."""
    x, y = run.series(VARIANCE)
    return set(x[y > 0].tolist()) if len(x) else None


def layer_profile(v: Variant, prefix: str = LAYER) -> tuple[list[int], np.ndarray, np.ndarray | None,
                                                               np.ndarray | None]:
    """(layers, mean, lo, hi): per MoE layer, each run's mean flip rate over its steps with gradient, then the mean
    over seeds with its 95% t-band (lo/hi None for one seed). Layers are those every such run logged; a run without
    a step with gradient is left out."""
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
    return layers, mean, lo, hi


def expert_churn(v: Variant, prefix: str) -> dict[int, float]:
    """{expert: mean over steps and seeds of `prefix`<e>} (churn in or out, relative to the expert's slots in the
    old routing, summed over layers)."""
    vals: dict[int, list[float]] = {}
    for r in v.runs:
        _, ids, M = r.matrix(prefix)
        for j, e in enumerate(ids):
            if np.isfinite(M[j]).any():
                vals.setdefault(e, []).append(float(np.nanmean(M[j])))
    return {e: float(np.mean(x)) for e, x in sorted(vals.items())}


def seed_panels(path: Path, variants: Sequence[Variant], key: str, title: str, ylabel: str, base: str,
                window: int = 5, marks: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    """One panel per variant: each seed's `window`-step moving average (thin), their mean (bold) and its 95% t-band
    across seeds (shaded; cut at the range of all observed values, as the metric cannot leave it), the baseline's
    mean (grey dashes) for reference, and `marks` {variant: [(step, value)]} as crosses."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ncols = min(3, len(variants))
    nrows = -(-len(variants) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.0 * nrows + 0.5), sharex=True, sharey=True,
                             squeeze=False)
    raw = np.concatenate([v.matrix(key)[1].ravel() for v in variants])
    lo_clip, hi_clip = (float(raw.min()), float(raw.max())) if raw.size else (-np.inf, np.inf)
    bx, BY = next((v.matrix(key) for v in variants if v.name == base), (np.array([]), np.zeros((0, 0))))
    base_mean = np.stack([smooth(row, window) for row in BY]).mean(0) if BY.size else None
    for ax, v, c in zip(axes.ravel(), variants, colors(len(variants))):
        x, Y = v.matrix(key)
        ax.set_title(f"{v.name} ({Y.shape[0]} seed{'s' if Y.shape[0] != 1 else ''})", fontsize=10)
        ax.grid(alpha=0.3)
        if not len(x):
            continue
        S = np.stack([smooth(row, window) for row in Y])
        mean, lo, hi = band(S)
        for row in S:
            ax.plot(x, row, color=c, lw=0.7, alpha=0.45)
        if lo is not None:
            ax.fill_between(x, np.clip(lo, lo_clip, hi_clip), np.clip(hi, lo_clip, hi_clip), color=c, alpha=0.18,
                            lw=0)
        ax.plot(x, mean, color=c, lw=2.0)
        if base_mean is not None and v.name != base:
            ax.plot(bx, base_mean, color="0.35", lw=1.2, ls="--")
        for sx, sy in (marks or {}).get(v.name, []):
            ax.plot([sx], [sy], marker="x", ms=9, mew=2, color="black", ls="none")
    spare = axes.ravel()[len(variants):]
    for ax in spare:
        ax.set_axis_off()
    for c in range(ncols):  # step labels under the lowest panel of each column
        r = max(r for r in range(nrows) if r * ncols + c < len(variants))
        axes[r, c].xaxis.set_tick_params(labelbottom=True)
        axes[r, c].set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles = [Line2D([], [], color="0.2", lw=0.7, alpha=0.6, label="one seed"),
               Line2D([], [], color="0.2", lw=2.0, label="mean over seeds"),
               Patch(color="0.2", alpha=0.18, label="95% t-band of the mean"),
               Line2D([], [], color="0.35", lw=1.2, ls="--", label=f"{base}: mean over seeds"),
               Line2D([], [], color="black", marker="x", ls="none", mew=2, label="collapse begins")]
    fig.suptitle(title)
    if len(spare):  # the key goes in an empty grid cell, else to the right of the panels
        spare[0].legend(handles=handles, loc="center", fontsize=9, frameon=False)
    else:
        fig.tight_layout()
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    return _save(fig, path)


def run_config(run: Run) -> dict:
    """The resolved config a run wrote (RUN_DIR/config.yaml), {} when it is missing."""
    import yaml

    p = run.dir / "config.yaml"
    return (yaml.safe_load(p.read_text()) or {}) if p.is_file() else {}


def clip_used(algorithm: dict) -> tuple[float, float] | None:
    """(clip_low, clip_high) the loss ran with: the config's values, else the loss's registered default."""
    from moe_gspo.losses import DEFAULT_CLIP

    default = DEFAULT_CLIP.get(algorithm.get("loss"))
    lo, hi = algorithm.get("clip_low"), algorithm.get("clip_high")
    if default is None and (lo is None or hi is None):
        return None
    return (default[0] if lo is None else float(lo), default[1] if hi is None else float(hi))


def _settings(cfg: dict) -> dict[str, str]:
    """The settings an RL reader needs to place a run, as table cells (SETTINGS_ROWS order)."""
    m, r, t, a = (cfg.get(k) or {} for k in ("model", "rollout", "train", "algorithm"))
    g = lambda d, k: d.get(k, "?")  # noqa: E731
    return {
        "model": f"{g(m, 'num_hidden_layers')} MoE layers, hidden {g(m, 'hidden_size')}, {g(m, 'num_experts')} "
                 f"experts (top-{g(m, 'num_experts_per_tok')}), expert FFN {g(m, 'moe_intermediate_size')}, "
                 f"{g(m, 'num_attention_heads')} attention heads",
        "task": f"{g(r, 'task')}" + (f" ({r['task_args']})" if r.get("task_args") else ""),
        "max response tokens": str(g(r, "max_new_tokens")),
        "RL steps": str(g(t, "steps")),
        "rollout batch": f"{g(r, 'prompts_per_step')} prompts x {g(r, 'group_size')} responses (group size "
                         f"{g(r, 'group_size')}), temperature {g(r, 'temperature')}",
        "learning rate": f"{g(t, 'lr')} ({g(t, 'lr_decay')}, {g(t, 'lr_warmup_steps')} warmup steps)",
        "minibatches per rollout batch": f"{g(t, 'minibatches')} optimizer steps per rollout batch (micro-batch "
                                         f"{g(t, 'micro_batch_size')})",
        "optimizer": f"Adam ({g(t, 'adam_beta1')}, {g(t, 'adam_beta2')}), weight decay {g(t, 'weight_decay')}, "
                     f"gradient-norm clip {g(t, 'grad_clip')}",
        "precision": f"trainer {g(m, 'params_dtype')}, rollout engine {g(r, 'engine')} in {g(r, 'engine_dtype')}",
        "loss": f"{g(a, 'loss')}, {g(a, 'loss_agg_mode')}, KL beta {g(a, 'kl_beta')}",
        "clip range used (low, high)": (f"({c[0]:g}, {c[1]:g})" + ("" if a.get("clip_low") is not None and
                                                                 a.get("clip_high") is not None else
                                                                 " loss default")
                                        if (c := clip_used(a)) else "?"),
        "routing replay": str(g(a, "routing_replay")),
        "pi_old log-probs": "rollout engine" if a.get("use_engine_logprobs") else "training engine (recomputed)",
        "cold start": f"{g(t, 'cold_start_steps')} supervised steps, lr {g(t, 'cold_start_lr')}, batch "
                      f"{g(t, 'cold_start_batch_size')}",
    }


def settings_tables(variants: Sequence[Variant]) -> tuple[list[list], list[str], list[list]]:
    """(shared rows [setting, value], per-variant header, per-variant rows) from each variant's first run's
    config.yaml: a setting with one value across variants goes in the shared table, the others get a column."""
    cells = {v.name: _settings(run_config(v.runs[0])) for v in variants if v.runs}
    if not cells:
        return [], [], []
    keys = list(next(iter(cells.values())))
    differ = [k for k in keys if len({c[k] for c in cells.values()}) > 1]
    seeds = sorted({s for v in variants for s in v.seeds if s is not None})
    shared = [[k, next(iter(cells.values()))[k]] for k in keys if k not in differ]
    shared.append(["seeds", f"{len(seeds)} paired seeds ({', '.join(map(str, seeds))})" if seeds else "one run"])
    return shared, ["variant", *differ], [[name, *(c[k] for k in differ)] for name, c in cells.items()]


SUMMARY_HEADER = ["variant", "seeds", "steps", "reward, step 1 (mean over seeds)", "final reward (mean over seeds)",
                  "95% t-interval", "runs that collapsed", "mean pg_clipfrac", "clip fraction / baseline's",
                  "mean flip rate", "mean rollout-train mismatch", "mean rollout_probs_diff",
                  "wall time (s, all seeds)"]
DIFF_HEADER = ["variant", "seeds paired", "mean difference of final reward", "95% t-interval", "verdict"]
RUN_HEADER = ["variant", "seed", "reward, step 1", "final reward", "collapses",
              "steps with gradient (some group with reward variance)", "wall time (s)"]
METRIC_HEADER = ["variant", "pg_clipfrac, steps with gradient [95% t]", "clip fraction / baseline's, paired [95% t]",
                 "flip rate, steps with gradient [95% t]", "rollout-train routing mismatch [95% t]",
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


def _read_meta(out: Path) -> dict:
    p = out / "compare.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def volatility_section(out: Path, variants: Sequence[Variant], window: int, smooth_text: str) -> str:
    """The expert-volatility part of the report: flip rate per step (every seed), the per-layer flip profile with
    its t-band across seeds, per-expert churn, and the first seed's layer x step heatmaps (volatility.html)."""
    png = lambda name: out / f"compare_{name}.png"  # noqa: E731
    if not any(len(r.series(FLIP)[0]) for v in variants for r in v.runs):
        return (f"<h2>Expert volatility</h2><p class='note'>No '{FLIP}' metrics in these runs (was "
                "algorithm.track_flips on?).</p>")
    parts = ["<h2>Expert volatility</h2><p class='note'>A flip is a top-k slot whose expert differs (set-wise) "
             "between the old policy's routing of a rollout token and the live routing of the same token in a "
             "training forward of the step.</p>"]
    f = mean_curves(png("flip_rate"), variants, FLIP, "Expert flip rate per step (all MoE layers)",
                    "fraction of top-k slots", window)
    parts.append(html.figure(f.name, f"Flip rate per step, averaged over the step's minibatches ({smooth_text})."))
    profiles = []
    for v in variants:
        layers, mean, lo, hi = layer_profile(v)
        if layers:  # a rate is >= 0: the band is cut there
            profiles.append((v.name, layers, mean, None if lo is None else np.maximum(lo, 0.0), hi))
    if profiles:
        f = band_plot(png("flip_layers"), profiles, "Flip rate per MoE layer", "MoE layer (0 = first)",
                      "fraction of top-k slots")
        parts.append(html.figure(f.name, "Per MoE layer, each run's mean flip rate over its steps with gradient "
                                         "(some group with reward variance), averaged over the seeds that have such steps; shaded "
                                         "where two or more do: the 95% t-band across them."))
    bars = []
    for label, prefix in (("slots lost (out)", CHURN_OUT), ("slots gained (in)", CHURN_IN)):
        churn = {v.name: expert_churn(v, prefix) for v in variants}
        ids = sorted({e for c in churn.values() for e in c})
        if ids:
            bars.append((label, ids, {name: [c.get(e, 0.0) for e in ids] for name, c in churn.items()}))
    if bars:
        f = grouped_bars(png("churn"), bars, "Per-expert churn", "expert", "slots / old-routing slots")
        parts.append(html.figure(f.name, "Top-k slots each expert lost and gained per step, relative to the slots it "
                                         "held in the old routing of the same tokens (summed over layers), mean over "
                                         "steps and seeds."))
    firsts = [v.runs[0] for v in variants]
    try:
        vol = write_volatility_report([r.dir for r in firsts], out / "volatility.html")
    except ValueError:
        return "".join(parts)
    which = f" of seed {variants[0].seeds[0]}" if variants[0].seeds[0] is not None else ""
    if (out / f"{vol.stem}_heatmap.png").is_file():
        parts.append(html.figure(f"{vol.stem}_heatmap.png", f"Flip rate per MoE layer (rows) and step (columns), "
                                                            f"the runs{which}."))
    parts.append(f"<p class='note'>Per-run tables and figures: <a href='{vol.name}'>{vol.name}</a>.</p>")
    return "".join(parts)


def write_compare_report(out_dir: str | Path, names: Sequence[str], walls: dict[str, float] | None = None,
                         cold_start_seconds=None) -> Path:
    """Write DIR/report.html and its PNGs from the runs of `names`; returns the HTML path. `walls`: seconds per run
    label ('grpo/seed_0'), else read from each run's wall_time.json."""
    out = Path(out_dir)
    meta = _read_meta(out)
    known = {f.name for f in dataclasses.fields(CompareConfig)}
    settings = CompareConfig(**{k: v for k, v in (meta.get("settings") or {}).items() if k in known})
    variants = load_variants(out, names, meta.get("seeds"))
    walls = run_walls(variants, walls)
    base, stats = variant_stats(variants, settings)
    n_seeds = max(len(v.runs) for v in variants)
    cold = cold_start_seconds if cold_start_seconds is not None else meta.get("cold_start_seconds")
    cold_total = sum(cold.values()) if isinstance(cold, dict) else cold
    png = lambda name: out / f"compare_{name}.png"  # noqa: E731
    seeds_text = (f"{n_seeds} seeds per variant ({', '.join(str(s) for s in variants[0].seeds)}), the same for "
                  "every variant: a seed sets the initial weights, the cold start, the prompts and the sampling, "
                  "and all variants of a seed start from the same cold-started weights" if n_seeds > 1 else
                  "one seed per variant: no intervals (run with --seeds N, N >= 2, for them); all variants start "
                  "from the same cold-started weights with the same prompts and sampling seeds")
    parts = [f"<p class='note'>Variants: {html.esc(', '.join(names))}; {html.esc(seeds_text)}. GRPO uses the "
             "token-level ratio, GSPO the length-normalized sequence ratio (clip ranges in the settings table). R2 "
             "replays the training engine's old routing, R3 the rollout engine's."
             + (f" Cold start took {cold_total:.0f} s in all." if cold_total else "") + "</p>"]
    shared, vheader, vrows = settings_tables(variants)
    if shared:
        parts.append("<h2>Run settings</h2>" + html.table(["setting", "value (every variant)"], shared)
                     + (html.table(vheader, vrows) if len(vheader) > 1 else "")
                     + "<p class='note'>Read from each variant's first run's config.yaml. Minibatch k of a rollout "
                     "batch is trained after k−1 optimizer steps on the same batch (off-policy by k−1 "
                     "updates).</p>")
    parts.append("<h2>Summary</h2>" + html.table(SUMMARY_HEADER, summary_rows(variants, stats, base, walls)))
    parts.append(
        f"<p class='note'>Final reward: the mean training reward of a run's last {settings.final_window} steps; per "
        "variant, the mean over seeds with its 95% Student-t interval (mean \u00b1 t<sub>0.975, n\u22121</sub> "
        "\u00b7 s / \u221an over the n seeds' final rewards). A run collapses when its "
        f"{settings.smooth_window}-step moving-average reward falls below {settings.collapse_fraction:g} of its "
        f"running peak (peaks below {settings.collapse_min_peak:g} count as {settings.collapse_min_peak:g}) and "
        f"stays below for at least {settings.collapse_patience} steps.</p>")
    drows = diff_rows(variants, stats)
    if drows:
        parts.append(f"<h2>Each variant vs {html.esc(base)}</h2>" + html.table(DIFF_HEADER, drows)
                     + f"<p class='note'>Per seed, the variant's final reward minus {html.esc(base)}'s at the same "
                     "seed (same cold start, same prompts); the interval is the Student-t interval of these "
                     "differences. An interval that covers 0 reads \u201cnot distinguishable at this budget\u201d: "
                     "more seeds or steps could still separate them.</p>")
    parts.append("<h2>Clipping, expert volatility and engine mismatch</h2>"
                 + html.table(METRIC_HEADER, metric_rows(variants, base))
                 + "<p class='note'>Each run's mean over its steps (the clip fraction and the flip rate over the "
                 "steps where some group had reward variance: a step without one has no gradient, so it clips "
                 "nothing and no expert moves; a run with no such step is left out); per variant, the mean over "
                 "seeds and its 95% Student-t interval. The clip-fraction ratio is taken per seed "
                 f"against {html.esc(base)} and averaged on the log scale (geometric mean; the interval is exp of "
                 "the t-interval of the log-ratios).</p>")
    parts.append("<h2>Runs</h2>" + html.table(RUN_HEADER, run_rows(variants, stats, walls)))
    same = identical_variants(variants, REWARD)
    if same:
        parts.append("<p class='note'>Identical reward curves (the variants computed the same thing here, e.g. R2 and "
                     "R3 when the rollout engine routes exactly like the trainer): "
                     + html.esc(", ".join(f"{a} = {b}" for a, b in same)) + ".</p>")
    parts.append("<p class='note'>pg_clipfrac is the fraction of response tokens on the clipped branch (for GSPO: "
                 "tokens of clipped sequences). The GSPO paper reports about 100x more clipping for GSPO than GRPO "
                 "(~15% vs ~0.13%) with better training reward; a tiny model trained for a few steps need not "
                 "reproduce that.</p>")

    w = settings.smooth_window
    marks = {}
    for v in variants:
        for r, events in zip(v.runs, stats[v.name].collapses):
            x, y = r.series(REWARD)
            s = smooth(y, w) if len(y) else y
            marks.setdefault(v.name, []).extend((x[c.start], s[c.start]) for c in events)
    smooth_text = (f"faint: the mean over seeds at each step; bold: its {w}-step trailing moving average"
                   if n_seeds > 1 else f"faint: raw; bold: {w}-step trailing moving average")
    reward = [(mean_curves(png("reward"), variants, REWARD, "Training reward (mean over the rollout batch)",
                           "reward", w),
               f"Mean reward of each step's rollouts ({smooth_text})."
               + (" The spread over seeds is in the next figure." if n_seeds > 1 else
                  " One seed: no confidence band (run with --seeds N for one)."))]
    if n_seeds > 1 or any(marks.values()):
        reward.append((seed_panels(png("reward_seeds"), variants, REWARD, "Training reward per variant", "reward",
                                   base, w, marks),
                       f"Per variant: each seed's {w}-step moving average of the reward (thin), their mean (bold) "
                       "with its 95% Student-t band across seeds (shaded, cut at the range of observed rewards), "
                       f"{base}'s mean for reference (grey dashes), and crosses where a collapse began."))
    if all(np.array_equal(r.series(REWARD)[1], r.series(ACC)[1]) for v in variants for r in v.runs):
        acc = ("<p class='note'>Accuracy (the fraction of responses with reward 1) equals the mean reward at every "
               "step of every run here (the rewards are 0 or 1), so it has no figure of its own.</p>")
    else:
        acc = html.figure(mean_curves(png("accuracy"), variants, ACC, "Accuracy of sampled responses",
                                      "fraction with reward 1", w).name,
                          f"Fraction of sampled responses that are correct ({smooth_text}).")
    parts.append("<h2>Reward and accuracy</h2>" + "".join(html.figure(f.name, c) for f, c in reward) + acc)
    clip = mean_curves(png("clipfrac"), variants, CLIP, "Clip fraction (log scale)", "pg_clipfrac", w, log=True)
    parts.append("<h2>Clipping</h2>" + html.figure(
        clip.name, f"Fraction of response tokens on the clipped branch per step (GSPO: tokens of clipped "
                   f"sequences; {smooth_text}); values of 0 are gaps."))
    parts.append(volatility_section(out, variants, w, smooth_text))
    engine = [
        (mean_curves(png("mismatch"), variants, MISMATCH, "Rollout engine vs training engine routing (old policy)",
                     "fraction of top-k slots differing", w),
         f"Set-wise routing mismatch of rollout tokens between the rollout engine and the megatron training "
         f"forward at the same weights ({smooth_text})."),
        (mean_curves(png("probs_diff"), variants, PDIFF, "Rollout vs recomputed token probabilities (log scale)",
                     "mean |p_engine - p_train|", w, log=True),
         f"Mean absolute difference of response-token probabilities, rollout engine vs training engine "
         f"({smooth_text})."),
    ]
    parts.append("<h2>Rollout vs training</h2>" + "".join(html.figure(f.name, c) for f, c in engine))
    report = out / "report.html"
    report.write_text(html.page("GSPO vs GRPO on an MoE policy", parts))
    return report
