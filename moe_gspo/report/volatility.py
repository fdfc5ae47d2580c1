"""Expert-volatility report: how much MoE routing of the same rollout tokens changes per gradient step.

    moe-gspo report volatility RUN_DIR [RUN_DIR ...] [--out FILE.html]
    write_volatility_report(["runs/grpo", "runs/gspo"])   # -> runs/grpo/volatility.html

Reads each RUN_DIR/metrics.jsonl (keys written by moe_gspo.routing.ExpertFlipTracker: moe/flip_rate,
moe/flip_rate/layer_{i}, moe/churn_in/expert_{e}, moe/churn_out/expert_{e}, moe/rollout_train_mismatch) and
writes, next to the HTML (default: the first run dir's volatility.html): volatility_heatmap.png (layer x step),
volatility_flip_rate.png (overall flip rate, one line per run; engine mismatch dashed), volatility_churn.png
(mean per-expert churn), volatility_sources.png (per MoE layer, the flips from the expert-bias update and from
the gradient, for runs whose router has an updated expert bias: moe/flip_rate_from_{bias,gradient}/layer_{i}),
plus a summary table in the HTML.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_gspo.config import UserError
from moe_gspo.report import html
from moe_gspo.report.plots import Run, grouped_bars, heatmap_panels, line_plot, load_runs

FLIP, LAYER, MISMATCH = "moe/flip_rate", "moe/flip_rate/layer_", "moe/rollout_train_mismatch"
CHURN_IN, CHURN_OUT = "moe/churn_in/expert_", "moe/churn_out/expert_"
BIAS, GRADIENT = "moe/flip_rate_from_bias/layer_", "moe/flip_rate_from_gradient/layer_"


def summary_row(run: Run) -> list:
    """[run, steps, mean, last, max (step), most volatile layer, most churned expert, mean mismatch]."""
    steps, flips = run.series(FLIP)
    _, layers, M = run.matrix(LAYER)
    _, experts, C = run.matrix(CHURN_OUT)
    _, mism = run.series(MISMATCH)
    nanmean = lambda a, axis=None: np.nanmean(a, axis=axis) if np.isfinite(a).any() else np.nan  # noqa: E731
    hot_layer = (f"{layers[int(np.nanargmax(nanmean(M, 1)))]} ({np.nanmax(nanmean(M, 1)):.3g})"
                 if layers and np.isfinite(M).any() else None)
    hot_expert = (f"{experts[int(np.nanargmax(nanmean(C, 1)))]} ({np.nanmax(nanmean(C, 1)):.3g})"
                  if experts and np.isfinite(C).any() else None)
    if not len(flips):
        return [run.label, 0, None, None, None, hot_layer, hot_expert, None]
    i = int(np.argmax(flips))
    return [run.label, len(flips), float(flips.mean()), float(flips[-1]), f"{flips[i]:.3g} (step {int(steps[i])})",
            hot_layer, hot_expert, float(mism.mean()) if len(mism) else None]


def write_volatility_report(run_dirs: Sequence[str | Path], out_html: str | Path | None = None) -> Path:
    """Write the volatility HTML and its PNGs; returns the HTML path. Raises if no run has flip metrics."""
    if not run_dirs:
        raise UserError("report volatility: give at least one run directory")
    runs = load_runs(run_dirs)
    have = [r for r in runs if len(r.series(FLIP)[0])]
    if not have:
        raise UserError(f"report volatility: no '{FLIP}' metrics in {', '.join(str(r.dir) for r in runs)} "
                         f"(was algorithm.track_flips on?)")
    out = Path(out_html) if out_html is not None else Path(run_dirs[0]) / "volatility.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    png = lambda name: out.parent / f"{out.stem}_{name}.png"  # noqa: E731
    parts = [f"<p class='note'>Runs: {html.esc(', '.join(f'{r.label} ({r.dir})' for r in runs))}. A flip is a "
             "top-k slot whose expert differs (set-wise) between the old policy's routing of a rollout token and "
             "the current policy's live routing of the same token, measured in the training forwards of a step. "
             "For scale: about 10% in the 48-layer Qwen3-30B-A3B after one update (GSPO paper).</p>"]

    parts.append("<h2>Summary</h2>" + html.table(
        ["run", "steps", "mean flip rate", "last", "max", "most volatile layer (mean)",
         "most churned expert (mean out)", "mean rollout-train mismatch"], [summary_row(r) for r in runs]))

    lines = [(r.label, *r.series(FLIP)) for r in have]
    dashed = [(f"{r.label} rollout-train mismatch", *r.series(MISMATCH)) for r in have]
    fig = line_plot(png("flip_rate"), lines, "Expert flip rate per step (all layers)", "fraction of top-k slots",
                    dashed=[d for d in dashed if len(d[1])])
    parts.append("<h2>Flip rate over training</h2>" + html.figure(
        fig.name, "Overall flip rate per step, one line per run; dashed: rollout engine vs training routing."))

    panels = [(r.label, *r.matrix(LAYER)) for r in have if r.indexed(LAYER)]
    if panels:
        fig = heatmap_panels(png("heatmap"), panels, "Flip rate", "MoE layer", "flip rate")
        parts.append("<h2>Per layer</h2>" + html.figure(fig.name, "Flip rate per MoE layer (rows) and step (columns)."))

    sources = []
    for r in have:
        means = {}
        for name, prefix in (("expert-bias update", BIAS), ("gradient", GRADIENT)):
            _, got, M = r.matrix(prefix)
            means[name] = {i: (np.nanmean(M[j]) if np.isfinite(M[j]).any() else 0.0) for j, i in enumerate(got)}
        ids = sorted(set(means["expert-bias update"]) | set(means["gradient"]))
        if ids:
            sources.append((r.label, ids, {n: [m.get(i, 0.0) for i in ids] for n, m in means.items()}))
    if sources:
        fig = grouped_bars(png("sources"), sources, "Flips by source (mean over steps)", "MoE layer",
                           "fraction of top-k slots")
        parts.append("<h2>Expert bias and gradient</h2>" + html.figure(
            fig.name, "Per MoE layer: the flips the expert-bias updates alone caused (the same live logits under the "
                      "old policy's bias against the current one) and those the weight updates caused (the live "
                      "logits under the old bias against the old routing). Their sum can exceed the flip rate: a "
                      "slot one source flips the other may flip back."))

    bars = []
    for r in have:
        ids = sorted(set(r.indexed(CHURN_IN)) | set(r.indexed(CHURN_OUT)))
        if ids:
            groups = {}
            for name, prefix in (("gained (in)", CHURN_IN), ("lost (out)", CHURN_OUT)):
                _, got, M = r.matrix(prefix)
                row = {e: (np.nanmean(M[i]) if np.isfinite(M[i]).any() else 0.0) for i, e in enumerate(got)}
                groups[name] = [row.get(e, 0.0) for e in ids]
            bars.append((r.label, ids, groups))
    if bars:
        fig = grouped_bars(png("churn"), bars, "Per-expert churn (mean over steps)", "expert",
                           "slots / reference slots")
        parts.append("<h2>Per expert</h2>" + html.figure(
            fig.name, "Slots each expert gained and lost per step, relative to the slots it held in the old "
                      "routing of the same tokens (summed over layers), averaged over steps."))

    out.write_text(html.page("Expert volatility", parts))
    return out
