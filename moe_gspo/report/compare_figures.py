"""The comparison report's figures: per-step curves of every variant (the mean over seeds faint, its trailing moving
average bold, legends outside the axes), each variant's seeds with the 95% t-band and collapse marks, and the
expert-volatility section (flip rate per step and per MoE layer, the per-layer split into the flips of the expert
bias and of the gradient with its table, per-expert churn, the first seed's heatmaps). A variant has one color in
every figure (variant_colors); what is not a variant (a flip's source, the baseline's reference) is drawn by line
style or in grey. Flip rates, mismatch and churn are in percent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_gspo.config import UserError
from moe_gspo.report import html
from moe_gspo.report.compare_data import FLIP, SPLIT, Variant, expert_churn, flip_split_rows, layer_profile
from moe_gspo.report.plots import DASHES, _save, band_plot, colors, grouped_bars, legend_outside, plt
from moe_gspo.report.stats import band, smooth
from moe_gspo.report.volatility import CHURN_IN, CHURN_OUT, MIN_CHURN_SLOTS, write_volatility_report

SOURCE_STYLES = {"bias": ":", "gradient": "-"}
"""Line style of each flip source in the split figure (the color is the variant's)."""


def variant_colors(variants: Sequence[Variant]) -> dict[str, tuple]:
    """{variant: its color}, the same in every figure of the report."""
    return {v.name: c for v, c in zip(variants, colors(len(variants)))}


def curve(v: Variant, key: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, raw, smoothed): the mean over seeds of `key` at each step, and its `window`-step trailing moving
    average (equal to the mean over seeds of each run's moving average)."""
    x, Y = v.matrix(key)
    raw = Y.mean(0) if Y.size else np.zeros(0)
    return x, raw, smooth(raw, window) if len(raw) else raw


def mean_curves(path: Path, variants: Sequence[Variant], key: str, title: str, ylabel: str, window: int = 5,
                log: bool = False, scale: float = 1.0) -> Path:
    """One line per variant: the mean over seeds of `key` (times `scale`: 100 for percent) faint and its
    `window`-step moving average bold (the spread over seeds is in `seed_panels`). On a log axis, values <= 0 are
    gaps and the steps where the raw mean is 0 are counted in the legend."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i, (v, c) in enumerate(zip(variants, variant_colors(variants).values())):
        x, raw, smoothed = curve(v, key, window)
        raw, smoothed = scale * raw, scale * smoothed
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
    for ax, v, c in zip(axes.ravel(), variants, variant_colors(variants).values()):
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


def volatility_section(out: Path, variants: Sequence[Variant], window: int, smooth_text: str) -> str:
    """The expert-volatility part of the report: flip rate per step (every seed), the per-layer flip profile with
    its t-band across seeds, per-expert churn, and the first seed's layer x step heatmaps (volatility.html)."""
    png = lambda name: out / f"compare_{name}.png"  # noqa: E731
    if not any(len(r.series(FLIP)[0]) for v in variants for r in v.runs):
        return (f"<h2>Expert volatility</h2><p class='note'>No '{FLIP}' metrics in these runs (was "
                "algorithm.track_flips on?).</p>")
    parts = ["<h2>Expert volatility</h2><p class='note'>A flip is a top-k slot whose expert differs (set-wise) "
             "between the old policy's routing of a rollout token and the live routing of the same token in a "
             "training forward of the step. Flip rates are in percent of top-k slots throughout. Only routed "
             "experts of MoE layers count: dense layers and shared experts have no routing.</p>"]
    f = mean_curves(png("flip_rate"), variants, FLIP, "Expert flip rate per step (all MoE layers)",
                    "% of top-k slots", window, scale=100)
    parts.append(html.figure(f.name, f"Flip rate per step in percent, averaged over the step's minibatches "
                                     f"({smooth_text})."))
    color = variant_colors(variants)
    pct = lambda a: None if a is None else 100 * a  # noqa: E731
    profiles = []
    for v in variants:
        layers, mean, lo, hi = layer_profile(v)  # the band is cut to [0, 1]: a rate cannot leave it
        if layers:
            profiles.append((v.name, layers, 100 * mean, pct(lo), pct(hi)))
    if profiles:
        f = band_plot(png("flip_layers"), profiles, "Flip rate per MoE layer", "MoE layer (0 = first)",
                      "% of top-k slots", [color[name] for name, *_ in profiles])
        parts.append(html.figure(f.name, "Per MoE layer, each run's mean flip rate over its steps with gradient "
                                         "(some group with reward variance) in percent, averaged over the seeds "
                                         "that have such steps; shaded where two or more do: the 95% t-band across "
                                         "them, cut at 0 and 100."))
    split = [(v.name, source, *layer_profile(v, f"moe/flip_rate_from_{source}/layer_"))
             for v in variants for source in SPLIT]
    split = [(f"{name}, {source}", layers, 100 * mean, pct(lo), pct(hi), color[name], SOURCE_STYLES[source])
             for name, source, layers, mean, lo, hi in split if layers]
    if split:
        f = band_plot(png("flip_sources"), [line[:5] for line in split],
                      "Flips from the expert-bias update and from the gradient", "MoE layer (0 = first)",
                      "% of top-k slots", [line[5] for line in split], [line[6] for line in split])
        header, rows = flip_split_rows(variants)
        parts.append(html.figure(f.name, "Per MoE layer, in percent of top-k slots, the flips the expert-bias "
                                         "updates alone caused (dotted: the live logits under the old bias against "
                                         "the current one) and those the weight updates caused (solid: the old "
                                         "bias, live logits against the old routing), in each variant's color; "
                                         "each run's mean over its steps with gradient, then over seeds.")
                     + html.table(header, rows, numeric=True)
                     + "<p class='note'>The same split as a table: flip rate in percent of top-k slots per MoE "
                       "layer (0 = the first MoE layer), and over all MoE layers in the last row. Their sum can "
                       "exceed the flip rate: a slot one source flips the other may flip back.</p>")
    bars, left_out = [], {}
    for label, prefix in (("slots lost (out)", CHURN_OUT), ("slots gained (in)", CHURN_IN)):
        churn = {v.name: expert_churn(v, prefix) for v in variants}
        left_out.update({name: gone for name, (_, gone) in churn.items() if gone})
        ids = sorted({e for c, gone in churn.values() for e in [*c, *gone]})
        if ids:  # a variant without churn metrics has no bars; a left-out expert is a gap
            bars.append((label, ids, {name: [100 * c.get(e, np.nan) for e in ids] for name, (c, gone) in churn.items()
                                      if c or gone}))
    if bars:
        f = grouped_bars(png("churn"), bars, "Per-expert churn", "expert", "% of its old-routing slots",
                         {name: {"color": c} for name, c in color.items()})
        gone = "; ".join(f"{name}: expert {', '.join(map(str, e))}" for name, e in left_out.items())
        parts.append(html.figure(f.name, "Top-k slots each expert lost and gained, in percent of the slots it held "
                                         "in the old routing of the same tokens; both are summed over the MoE "
                                         "layers, the steps with gradient and the seeds before dividing, so a step "
                                         "where an expert held few slots weighs little. Experts that held fewer "
                                         f"than {MIN_CHURN_SLOTS} slots in all are left out (a gap)"
                                         + (f": {gone}." if gone else ".")))
    elif any(r.indexed(CHURN_OUT) for v in variants for r in v.runs):
        parts.append("<p class='note'>No per-expert churn: pooling it needs the slots each expert held, from the "
                     "tracker's load metrics and top-k in each run's config.yaml, which these runs lack.</p>")
    firsts = [v.runs[0] for v in variants]
    try:
        vol = write_volatility_report([r.dir for r in firsts], out / "volatility.html")
    except UserError:  # no run with flip metrics: the section above already says so
        return "".join(parts)
    which = f" of seed {variants[0].seeds[0]}" if variants[0].seeds[0] is not None else ""
    if (out / f"{vol.stem}_heatmap.png").is_file():
        parts.append(html.figure(f"{vol.stem}_heatmap.png", f"Flip rate per MoE layer (rows) and step (columns) in "
                                                            f"percent, the runs{which}."))
    parts.append(f"<p class='note'>Per-run tables and figures: <a href='{vol.name}'>{vol.name}</a>.</p>")
    return "".join(parts)
