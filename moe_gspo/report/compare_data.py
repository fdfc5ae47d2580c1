"""What a comparison's report states, as data: each variant's runs (DIR/<variant>/seed_<s>/metrics.jsonl), their
statistics (final reward with its 95% t-interval, the paired difference against the baseline with a verdict,
collapses; moe_gspo/report/stats.py), and the rows of the report's tables (settings, summary, differences, runs,
clipping / volatility / mismatch). compare.py writes them as HTML, summary_lines as text for the terminal.
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
from moe_gspo.report.stats import Interval, band, collapses, final_value, t_interval, verdict
from moe_gspo.report.volatility import LAYER

REWARD, ACC, CLIP, CLIP_LO, FLIP = "reward/mean", "accuracy", "pg_clipfrac", "pg_clipfrac_lower", "moe/flip_rate"
MISMATCH, PDIFF, VARIANCE = "moe/rollout_train_mismatch", "rollout_probs_diff_mean", "groups/with_variance"
LOAD_RATIO, LOAD_ENTROPY = "moe/load_max_over_mean", "moe/load_entropy"  # moe_gspo/routing/tracker.py
LOAD_HEADER = ["variant", "flip rate % [95% t]", "load max/mean [95% t]", "load entropy / ln E [95% t]",
               "max/mean per layer", "entropy / ln E per layer"]


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


def load_rows(variants: Sequence[Variant]) -> list[list]:
    """Per variant (columns as in LOAD_HEADER): the flip rate beside the expert load, each a run's mean over its
    steps with gradient, then the mean over seeds with its 95% t-interval; per MoE layer the mean over seeds of the
    same run means. Load max/mean and entropy are the tracker's: the largest expert share of a layer's routed slots
    times E, and the entropy of the shares over ln E (1 = balanced), averaged over layers."""
    rows = []
    for v in variants:
        per_layer = []
        for key in (LOAD_RATIO, LOAD_ENTROPY):
            layers, m, _, _ = layer_profile(v, key + "/layer_")
            per_layer.append(" ".join(f"{x:.3f}" for x in m) if layers else "\u2014")
        rows.append([v.name, _pct(_iv([run_mean(r, FLIP, True) for r in v.runs])),
                     _cell(_iv([run_mean(r, LOAD_RATIO, True) for r in v.runs])),
                     _cell(_iv([run_mean(r, LOAD_ENTROPY, True) for r in v.runs])), *per_layer])
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


def run_config(run: Run) -> dict:
    """The resolved config a run wrote (RUN_DIR/config.yaml), {} when it is missing."""
    import yaml

    p = run.dir / "config.yaml"
    return (yaml.safe_load(p.read_text()) or {}) if p.is_file() else {}


def clip_used(algorithm: dict) -> tuple[float, float] | None:
    """(clip_low, clip_high) the loss ran with: the config's values, else the loss's registered default."""
    from moe_gspo.losses import POLICY_LOSSES

    cls = POLICY_LOSSES.get(algorithm.get("loss"))
    default = None if cls is None else cls.default_clip
    lo, hi = algorithm.get("clip_low"), algorithm.get("clip_high")
    if default is None and (lo is None or hi is None):
        return None
    return (default[0] if lo is None else float(lo), default[1] if hi is None else float(hi))


def _layers(m: dict) -> str:
    """'L MoE layers', or 'L layers (the first k dense)'."""
    L, k = m.get("num_hidden_layers", "?"), m.get("first_k_dense_replace") or 0
    return f"{L} MoE layers" if not k else f"{L} layers (the first {k} dense)"


def _settings(cfg: dict) -> dict[str, str]:
    """The settings an RL reader needs to place a run, as table cells (SETTINGS_ROWS order)."""
    m, r, t, a = (cfg.get(k) or {} for k in ("model", "rollout", "train", "algorithm"))
    g = lambda d, k: d.get(k, "?")  # noqa: E731
    return {
        "model": f"{_layers(m)}, hidden {g(m, 'hidden_size')}, {g(m, 'num_experts')} "
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
DIFF_HEADER = ["variant", "seeds paired", "mean difference of final reward", "95% t-interval", "verdict",
               "collapsed runs vs the baseline's, Fisher's exact p"]
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
    engine-vs-trainer routing mismatch in percent with their intervals, the paired difference against the baseline
    with its interval and verdict, and how many runs collapsed (the report's tables, in the same numbers)."""
    out = Path(out_dir)
    meta, settings = read_meta(out)
    variants = load_variants(out, list(meta["variants"]), meta.get("seeds"))
    base, stats = variant_stats(variants, settings)
    header = ["variant", "seeds", "final reward [95% t]", "flip rate % [95% t]", "engine mismatch % [95% t]",
              f"minus {base}, paired [95% t]", "verdict", "collapsed", "Fisher p"]
    rows = [header]
    for v in variants:
        st = stats[v.name]
        flip = _pct(_iv([run_mean(r, FLIP, True) for r in v.runs]))
        mismatch = _pct(_iv([run_mean(r, MISMATCH) for r in v.runs]))
        rows.append([v.name, str(len(v.runs)), _fmt(st.final), flip, mismatch,
                     "baseline" if v.name == base else _fmt(st.diff, True),
                     st.verdict or ("" if v.name == base else "no paired seeds"),
                     f"{sum(bool(e) for e in st.collapses)}/{len(st.collapses)}",
                     "" if v.name == base else f"{collapse_p(stats, v.name, base):.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
