"""The report of `moe-gspo study volatility`: flip rate vs depth, learning rate, minibatches and expert granularity,
per-layer profiles.

    write_study_report("runs/volatility")   # reads DIR/study.json and DIR/<point>/seed_<s>/metrics.jsonl

Writes DIR/report.html, DIR/study_table.csv (one row per point; `flip_rate` is the mean over steps and seeds of
moe/flip_rate) and beside them study_depth.png (flip rate vs depth: the seeds' means, their mean and min-max, and
the GSPO paper's ~10% at 48 layers), study_layers.png (per-layer profiles of the depth sweep) and study_sweeps.png
(flip rate vs learning rate and vs minibatches per rollout batch); with a granularity sweep also
study_granularity.png (flip rate vs experts, one line per top-k, one panel per depth) and
study_granularity_layers.png (per-layer profiles of those points). Every point's engine-vs-trainer routing mismatch
and token-probability gap are in the table where its runs logged them (a bf16 or fp16 rollout engine).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_gspo.config import UserError
from moe_gspo.report import html
from moe_gspo.report.plots import Run, colors, load_runs, plt

FLIP, LAYER = "moe/flip_rate", "moe/flip_rate/layer_"
MISMATCH, PDIFF = "moe/rollout_train_mismatch", "rollout_probs_diff_mean"
# docs/guide/method.md: in the 48-layer Qwen3-30B-A3B (128 experts, top-8) about 10% of activated experts change
# after one update
PAPER_DEPTH, PAPER_FLIP = 48, 0.10


@dataclass
class PointStats:
    """One grid point over its seeds: flip rate per seed (mean over steps), per layer (mean over steps and seeds)."""

    name: str
    depth: int
    lr: float
    minibatches: int
    seed_means: np.ndarray  # (S,) mean over steps of moe/flip_rate, one per seed
    layer_means: np.ndarray  # (L,) mean over steps and seeds of moe/flip_rate/layer_<i>
    reward: float  # mean over steps and seeds of reward/mean
    with_variance: float  # mean fraction of groups whose rewards differ (groups that carry a gradient)
    tokens: float  # mean response tokens observed per step (moe/flip_tokens): the sample behind a step's rate
    steps: int  # logged steps with a flip rate, summed over seeds
    wall: float  # seconds of all its runs (train(), cold start excluded)
    experts: int | None = None  # model.num_experts (None: not recorded in study.json)
    top_k: int | None = None
    expert_width: int | None = None
    mismatch: float = float("nan")  # mean over steps and seeds of moe/rollout_train_mismatch
    probs_diff: float = float("nan")  # mean over steps and seeds of rollout_probs_diff_mean

    @property
    def moe(self) -> tuple:
        return (self.experts, self.top_k, self.expert_width)

    @property
    def flip_rate(self) -> float:
        """Mean over seeds of the per-seed means (equal steps per seed: the mean over all steps and seeds)."""
        return float(self.seed_means.mean()) if self.seed_means.size else float("nan")


def point_stats(out: Path, meta: dict) -> list[PointStats]:
    stats = []
    for p in meta["points"]:
        runs = load_runs([out / p["name"] / f"seed_{s}" for s in meta["seeds"]])
        seed_means = np.array([r.series(FLIP)[1].mean() for r in runs if len(r.series(FLIP)[1])])
        stats.append(PointStats(
            p["name"], p["depth"], p["lr"], p["minibatches"], seed_means, _layer_means(runs, p["depth"]),
            _mean(runs, "reward/mean"), _mean(runs, "groups/with_variance"), _mean(runs, "moe/flip_tokens"),
            sum(len(r.series(FLIP)[1]) for r in runs),
            sum(meta["wall_seconds"].get(f"{p['name']}/seed_{s}", 0.0) for s in meta["seeds"]),
            p.get("experts"), p.get("top_k"), p.get("expert_width"), _mean(runs, MISMATCH), _mean(runs, PDIFF)))
    return stats


def _layer_means(runs: list[Run], depth: int) -> np.ndarray:
    """(depth,) mean over all steps of all runs of each layer's flip rate (nan for a layer never logged)."""
    vals = [[] for _ in range(depth)]
    for r in runs:
        _, ids, M = r.matrix(LAYER)
        for i, layer in enumerate(ids):
            if layer < depth:
                vals[layer].extend(M[i][np.isfinite(M[i])])
    return np.array([np.mean(v) if v else np.nan for v in vals])


def _mean(runs: list[Run], key: str) -> float:
    v = np.concatenate([r.series(key)[1] for r in runs])
    return float(v.mean()) if v.size else float("nan")


TABLE = ["point", "layers", "lr", "minibatches", "experts", "top_k", "expert_width", "seeds", "flip_rate", "seed_min",
         "seed_max", "per_update", "first_layer", "last_layer", "last_over_first_third", "most_volatile_layer",
         "reward", "groups_with_variance", "mismatch", "probs_diff", "tokens_per_step", "steps", "wall_s"]


def per_update(s: PointStats) -> float | None:
    """The drift after one update where the study measures exactly that: with 2 minibatches a step averages a
    forward before any update (0 by construction) and one after one update, so it is twice the step's rate."""
    return 2 * s.flip_rate if s.minibatches == 2 else None


def thirds_ratio(layer_means: np.ndarray) -> float | None:
    """Mean flip rate of the last third of the layers over the first third's (None under 3 layers or a 0 first)."""
    n = layer_means.size // 3
    if n < 1:
        return None
    first, last = np.nanmean(layer_means[:n]), np.nanmean(layer_means[-n:])
    return float(last / first) if first > 0 else None


def table_rows(stats: list[PointStats]) -> list[list]:
    rows = []
    for s in stats:
        finite = np.isfinite(s.layer_means)
        hot = int(np.nanargmax(s.layer_means)) if finite.any() and np.nanmax(s.layer_means) > 0 else None
        rows.append([s.name, s.depth, s.lr, s.minibatches, s.experts, s.top_k, s.expert_width, len(s.seed_means),
                     s.flip_rate, float(s.seed_means.min()) if s.seed_means.size else None,
                     float(s.seed_means.max()) if s.seed_means.size else None, per_update(s),
                     float(s.layer_means[0]) if finite[0] else None, float(s.layer_means[-1]) if finite[-1] else None,
                     thirds_ratio(s.layer_means), hot, s.reward, s.with_variance, _or_none(s.mismatch),
                     _or_none(s.probs_diff), s.tokens, s.steps, s.wall])
    return rows


def _or_none(x: float) -> float | None:
    return None if np.isnan(x) else x


def write_study_report(out_dir: str | Path) -> Path:
    """Write DIR/report.html, DIR/study_table.csv and the figures from DIR/study.json and the runs' metrics."""
    out = Path(out_dir)
    meta_path = out / "study.json"
    if not meta_path.is_file():
        raise UserError(f"{meta_path}: not found (DIR must be the --out of a `moe-gspo study volatility` run)")
    meta = json.loads(meta_path.read_text())
    stats = point_stats(out, meta)
    rows = table_rows(stats)
    with (out / "study_table.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TABLE)
        w.writerows([["" if c is None else c for c in r] for r in rows])

    base = meta["base"]
    own = tuple(base.get(k) for k in ("experts", "top_k", "expert_width"))
    plain = [s for s in stats if s.moe == own]  # the run config's expert layout
    depth_sweep = sorted([s for s in plain if (s.lr, s.minibatches) == (base["lr"], base["minibatches"])],
                         key=lambda s: s.depth)
    lr_sweep = sorted([s for s in plain if (s.depth, s.minibatches) == (base["depth"], base["minibatches"])],
                      key=lambda s: s.lr)
    mb_sweep = sorted([s for s in plain if (s.depth, s.lr) == (base["depth"], base["lr"])],
                      key=lambda s: s.minibatches)
    cfg = _run_config(out, stats[0].name, meta["seeds"][0])
    parts = [_intro(meta, cfg)]

    parts.append("<h2>Flip rate vs depth</h2>" + html.figure(
        _depth_figure(out / "study_depth.png", depth_sweep).name,
        f"Mean flip rate per step vs MoE layers at lr {base['lr']:g} and {base['minibatches']} minibatches per "
        f"rollout batch: each seed's mean over its steps (faint dots), their mean (line) and min-max (band); the star "
        f"is the GSPO paper's ~10% after one update in the 48-layer Qwen3-30B-A3B (128 experts, top-8)."))
    parts.append("<h2>Per-layer profiles</h2>" + html.figure(
        _layers_figure(out / "study_layers.png", depth_sweep).name,
        "Flip rate of each MoE layer (0 = nearest the embedding), mean over steps and seeds, one line per depth "
        "of the depth sweep."))
    parts.append("<h2>Flip rate vs learning rate and minibatches</h2>" + html.figure(
        _sweeps_figure(out / "study_sweeps.png", lr_sweep, mb_sweep, base).name,
        f"At {base['depth']} layers. Left: vs train.lr at {base['minibatches']} minibatches. Right: vs minibatches "
        f"per rollout batch (optimizer steps per step) at lr {base['lr']:g}. Dots: seeds; line: their mean; band: "
        f"min-max."))

    gran = meta.get("granularity")
    if gran:
        gpts = [s for s in stats if s.depth in gran["depths"] and (s.lr, s.minibatches) == (base["lr"],
                base["minibatches"]) and s.experts in gran["experts"] and s.top_k in gran["top_ks"]]
        parts.append("<h2>Flip rate vs expert granularity</h2>" + html.figure(
            _granularity_figure(out / "study_granularity.png", gpts, gran["depths"]).name,
            "Flip rate vs experts per layer, one line per top-k, one panel per depth; the active expert width per "
            "token (top-k x expert width) is the same at every point. With 2 minibatches per rollout batch the "
            "plotted rate is the drift after one update (twice the step mean), else the step mean. Dots: seeds' "
            "means; line: their mean; bars: min-max.") + html.figure(
            _layers_figure(out / "study_granularity_layers.png", sorted(gpts, key=lambda s: (s.depth, s.moe)),
                           lambda s: f"L{s.depth} E{s.experts} top-{s.top_k}").name,
            "Flip rate of each MoE layer for the granularity points, mean over steps and seeds."))

    pct = lambda v: None if v is None else 100 * v  # noqa: E731 - the HTML table shows percent
    shown = [[r[0], r[1], f"{r[2]:g}", *r[3:8], *map(pct, r[8:14]), *r[14:18], pct(r[18]), *r[19:]] for r in rows]
    parts.append("<h2>All points</h2>" + html.table(
        ["point", "layers", "lr", "minibatches", "experts", "top-k", "expert width", "seeds", "flip rate %",
         "seed min %", "seed max %", "after one update %", "first layer %", "last layer %",
         "last third / first third", "most volatile layer", "reward", "groups with variance",
         "engine-trainer routing mismatch %", "mean |p_engine - p_train|", "tokens per step", "steps (all seeds)",
         "wall s (all seeds)"], shown)
        + "<p class='note'>flip rate: mean over steps and seeds of moe/flip_rate; the same numbers as fractions are "
          "in study_table.csv. Wall seconds exclude the cold starts.</p>")
    report = out / "report.html"
    report.write_text(html.page("Expert volatility study", parts))
    return report


def _run_config(out: Path, point: str, seed: int) -> dict:
    import yaml

    p = out / point / f"seed_{seed}" / "config.yaml"
    return yaml.safe_load(p.read_text()) if p.is_file() else {}


def _intro(meta: dict, cfg: dict) -> str:
    m, r, t, a = (cfg.get(k, {}) for k in ("model", "rollout", "train", "algorithm"))
    total = meta.get("total_seconds")
    load = (meta.get("load_average") or {}).get("mean_over_runs")
    settings = [
        ["model", f"width {m.get('hidden_size')}, {m.get('num_experts')} experts, top-{m.get('num_experts_per_tok')}, "
                  f"expert width {m.get('moe_intermediate_size')}, {m.get('num_attention_heads')} heads"],
        ["task", f"{r.get('task')} ({r.get('task_args') or 'defaults'}), {r.get('max_new_tokens')} new tokens max"],
        ["rollout batch", f"{r.get('prompts_per_step')} prompts x {r.get('group_size')} responses, "
                          f"temperature {r.get('temperature')}, engine {r.get('engine')} ({r.get('engine_dtype')})"],
        ["loss", f"{a.get('loss')}, routing replay {a.get('routing_replay')}, clip "
                 f"({a.get('clip_low')}, {a.get('clip_high')}) (None: the loss's default)"],
        ["cold start", f"{t.get('cold_start_steps')} supervised steps of {t.get('cold_start_batch_size')} at lr "
                       f"{t.get('cold_start_lr')}, one per depth and seed"],
        ["RL steps per run", meta["steps"]], ["seeds", ", ".join(map(str, meta["seeds"]))],
        ["base point", f"{meta['base']['depth']} layers, lr {meta['base']['lr']:g}, "
                       f"{meta['base']['minibatches']} minibatches"],
        ["runs", f"{len(meta['points'])} points x {len(meta['seeds'])} seeds"],
        ["wall time", f"{total:.0f} s ({meta.get('cpu_seconds', float('nan')):.0f} s of CPU time), "
                      f"{meta.get('jobs', 1)} job(s) x {meta.get('threads')} thread(s); 1-minute load average "
                      f"{f'{load:.1f}' if load is not None else 'unknown'} (mean after each run) on "
                      f"{meta.get('cpus')} CPUs" if total else "unknown"],
    ]
    return ("<p class='note'>A flip is a top-k slot whose expert differs (set-wise) between the old policy's "
            "routing of a rollout token and the routing of the same token in a training forward of the same step. "
            "A step's flip rate averages its minibatch forwards; minibatch k is seen after k - 1 optimizer steps, so "
            "with M minibatches it is the mean drift after 0 .. M-1 updates (the GSPO paper's figure is after one "
            "update).</p><h2>Run settings</h2>" + html.table(["setting", "value"], settings))


# ------------------------------------------------------------------------------------------------------ figures
def _sweep_axes(ax, pts: list[PointStats], x_of, color, label: str) -> None:
    """Seeds' means as faint dots, their mean as a line, min-max as a band (in percent)."""
    x = np.array([x_of(s) for s in pts], dtype=float)
    for xi, s in zip(x, pts):
        ax.scatter(np.full(s.seed_means.size, xi), 100 * s.seed_means, color=color, alpha=0.35, s=14, lw=0)
    mean = np.array([100 * s.flip_rate for s in pts])
    lo = np.array([100 * s.seed_means.min() if s.seed_means.size else np.nan for s in pts])
    hi = np.array([100 * s.seed_means.max() if s.seed_means.size else np.nan for s in pts])
    ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
    ax.plot(x, mean, color=color, lw=1.8, marker="o", ms=4, label=label)


def _depth_figure(path: Path, pts: list[PointStats]) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4.2))
    if pts:
        _sweep_axes(ax, pts, lambda s: s.depth, colors(1)[0], "this study (mean of seeds, min-max band)")
    ax.scatter([PAPER_DEPTH], [100 * PAPER_FLIP], marker="*", s=180, color="black", zorder=5,
               label="GSPO paper: ~10% after one update, Qwen3-30B-A3B")
    ticks = sorted({s.depth for s in pts} | {PAPER_DEPTH})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(title="Expert flip rate vs depth", xlabel="MoE layers", ylabel="flip rate (% of top-k slots)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _granularity_figure(path: Path, pts: list[PointStats], depths: list[int]) -> Path:
    """Flip rate vs experts, a line per top-k, a panel per depth: the after-one-update rate (per_update) where every
    point has it, else the step mean. The paper's ~10% is named in the title rather than drawn, so that the axis
    keeps the resolution of our rates."""
    scale = 2.0 if pts and all(per_update(s) is not None for s in pts) else 1.0
    fig, axes = plt.subplots(1, len(depths), figsize=(4.6 * len(depths) + 1.5, 4.0), sharey=True, squeeze=False)
    ks = sorted({s.top_k for s in pts})
    for ax, d in zip(axes[0], depths):
        for k, c in zip(ks, colors(len(ks))):
            line = sorted([s for s in pts if s.depth == d and s.top_k == k], key=lambda s: s.experts)
            if not line:
                continue
            x = np.array([s.experts for s in line], dtype=float)
            for xi, s in zip(x, line):
                ax.scatter(np.full(s.seed_means.size, xi), 100 * scale * s.seed_means, color=c, alpha=0.35, s=14,
                           lw=0)
            y = np.array([100 * scale * s.flip_rate for s in line])
            lo = [yi - 100 * scale * s.seed_means.min() if s.seed_means.size else 0 for yi, s in zip(y, line)]
            hi = [100 * scale * s.seed_means.max() - yi if s.seed_means.size else 0 for yi, s in zip(y, line)]
            ax.errorbar(x, y, yerr=[lo, hi], color=c, lw=1.6, marker="o", ms=4, capsize=3, label=f"top-{k}")
        ax.set_xscale("log", base=2)
        xs = sorted({s.experts for s in pts})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set(title=f"{d} layers", xlabel="experts per layer")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    what = "after one update" if scale == 2.0 else "per step (mean over minibatches)"
    axes[0][0].set_ylabel(f"flip rate {what} (%)")
    fig.suptitle(f"Expert flip rate vs granularity (GSPO paper: ~{100 * PAPER_FLIP:.0f}% after one update at 128 "
                 f"experts, top-8, {PAPER_DEPTH} layers)", fontsize=10)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _layers_figure(path: Path, pts: list[PointStats], label=lambda s: f"{s.depth} layers") -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for s, c in zip(pts, colors(len(pts))):
        ax.plot(np.arange(s.depth), 100 * s.layer_means, color=c, lw=1.5, marker="o" if s.depth <= 16 else None,
                ms=3, label=label(s))
    ax.set(title="Flip rate per MoE layer", xlabel="layer", ylabel="flip rate (% of top-k slots)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if pts:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _sweeps_figure(path: Path, lr_pts: list[PointStats], mb_pts: list[PointStats], base: dict) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    c = colors(2)
    if lr_pts:
        _sweep_axes(a, lr_pts, lambda s: s.lr, c[0], "lr")
    a.set_xscale("log")
    a.set(title=f"vs learning rate ({base['minibatches']} minibatches)", xlabel="train.lr",
          ylabel="flip rate (% of top-k slots)")
    if mb_pts:
        _sweep_axes(b, mb_pts, lambda s: s.minibatches, c[1], "minibatches")
        b.set_xscale("log", base=2)
        b.set_xticks([s.minibatches for s in mb_pts], [str(s.minibatches) for s in mb_pts])
    b.set(title=f"vs minibatches per rollout batch (lr {base['lr']:g})", xlabel="train.minibatches")
    for ax in (a, b):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
