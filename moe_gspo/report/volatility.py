"""Expert-volatility report: how much MoE routing of the same rollout tokens changes per gradient step.

    moe-gspo report volatility RUN_DIR [RUN_DIR ...] [--out FILE.html]
    write_volatility_report(["runs/grpo", "runs/gspo"])   # -> runs/grpo/volatility.html

Reads each RUN_DIR/metrics.jsonl (keys written by moe_gspo.routing.ExpertFlipTracker: moe/flip_rate,
moe/flip_rate/layer_{i}, moe/churn_in/expert_{e}, moe/churn_out/expert_{e}, with moe/load/layer_{i}/expert_{e} and
moe/flip_tokens for the churn's denominators, moe/rollout_train_mismatch) and RUN_DIR/config.yaml (top-k), and
writes, next to the HTML (default: the first run dir's volatility.html): volatility_heatmap.png (layer x step),
volatility_flip_rate.png (overall flip rate, one line per run; engine mismatch dashed), volatility_churn.png
(per-expert churn, pooled over steps), volatility_sources.png (per MoE layer, the flips from the expert-bias update
and from the gradient, for runs whose router has an updated expert bias: moe/flip_rate_from_{bias,gradient}/layer_{i}),
plus a summary table in the HTML. Flip rates, mismatch and churn are in percent throughout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_gspo.config import UserError
from moe_gspo.report import html
from moe_gspo.report.plots import PARTS, Run, grouped_bars, heatmap_panels, line_plot, load_runs

FLIP, LAYER, MISMATCH = "moe/flip_rate", "moe/flip_rate/layer_", "moe/rollout_train_mismatch"
CHURN_IN, CHURN_OUT = "moe/churn_in/expert_", "moe/churn_out/expert_"
BIAS, GRADIENT = "moe/flip_rate_from_bias/layer_", "moe/flip_rate_from_gradient/layer_"
TOKENS, LOAD_SHARE = "moe/flip_tokens", re.compile(r"moe/load/layer_\d+/expert_(\d+)$")
MIN_CHURN_SLOTS = 100
"""An expert's churn is shown only when it held at least this many top-k slots in the old routing, summed over the
steps (and seeds) it is pooled over: a ratio to a handful of slots says nothing and would dwarf the others."""


def churn_counts(run: Run, prefix: str, keep: set[float] | None = None) -> dict[int, tuple[float, float]]:
    """{expert: (slots moved, slots held in the old routing)}, each summed over the run's steps (those in `keep`
    when given) and over the MoE layers; `prefix` is CHURN_IN (slots gained) or CHURN_OUT (slots lost).

    The tracker logs per step the ratio moved / max(held, 1); held is the expert's load shares summed over the
    layers times the tokens observed (moe/flip_tokens) times top-k (model.num_experts_per_tok in the run's
    config.yaml), so moved = ratio * max(held, 1). Steps without the load metrics, and runs without top-k, count
    nothing: a ratio without its denominator cannot be pooled."""
    k = (run.config().get("model") or {}).get("num_experts_per_tok")
    if not k:
        return {}
    share_keys = {key: int(m.group(1)) for rec in run.records for key in rec if (m := LOAD_SHARE.match(key))}
    out: dict[int, list[float]] = {}
    for rec in run.records:
        tokens = rec.get(TOKENS)
        if not isinstance(tokens, (int, float)) or (keep is not None and rec["step"] not in keep):
            continue
        shares: dict[int, float] = {}
        for key, e in share_keys.items():
            if isinstance(rec.get(key), (int, float)):
                shares[e] = shares.get(e, 0.0) + float(rec[key])
        if not shares:
            continue
        for e in shares:
            ratio = rec.get(f"{prefix}{e}")
            if isinstance(ratio, (int, float)) and np.isfinite(ratio):
                held = round(k * tokens * shares[e])
                acc = out.setdefault(e, [0.0, 0.0])
                acc[0] += float(ratio) * max(held, 1)
                acc[1] += held
    return {e: (moved, held) for e, (moved, held) in sorted(out.items())}


def pooled_churn(counts: Sequence[dict[int, tuple[float, float]]], min_slots: int = MIN_CHURN_SLOTS
                 ) -> tuple[dict[int, float], list[int]]:
    """({expert: slots moved / slots held}, experts left out) over `counts` (churn_counts of several runs): the
    counts are summed before dividing, so each slot weighs the same and a step or seed where an expert held few
    slots weighs little; an expert that held fewer than `min_slots` slots in all is left out."""
    moved: dict[int, float] = {}
    held: dict[int, float] = {}
    for c in counts:
        for e, (m, n) in c.items():
            moved[e], held[e] = moved.get(e, 0.0) + m, held.get(e, 0.0) + n
    shown = {e: moved[e] / held[e] for e in sorted(held) if held[e] >= min_slots}
    return shown, [e for e in sorted(held) if e not in shown]


def summary_row(run: Run) -> list:
    """[run, steps, mean, last, max (step), most volatile layer, most churned expert, mean mismatch], rates in
    percent; the churn pooled over the run's steps (pooled_churn)."""
    steps, flips = run.series(FLIP)
    flips = 100 * flips
    _, layers, M = run.matrix(LAYER)
    churn, _ = pooled_churn([churn_counts(run, CHURN_OUT)])
    _, mism = run.series(MISMATCH)
    nanmean = lambda a, axis=None: np.nanmean(a, axis=axis) if np.isfinite(a).any() else np.nan  # noqa: E731
    hot_layer = (f"{layers[int(np.nanargmax(nanmean(M, 1)))]} ({100 * np.nanmax(nanmean(M, 1)):.3g})"
                 if layers and np.isfinite(M).any() else None)
    hot = max(churn, key=churn.get) if churn else None
    hot_expert = None if hot is None else f"{hot} ({100 * churn[hot]:.3g})"
    if not len(flips):
        return [run.label, 0, None, None, None, hot_layer, hot_expert, None]
    i = int(np.argmax(flips))
    return [run.label, len(flips), float(flips.mean()), float(flips[-1]), f"{flips[i]:.3g} (step {int(steps[i])})",
            hot_layer, hot_expert, 100 * float(mism.mean()) if len(mism) else None]


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
        ["run", "steps", "mean flip rate %", "last %", "max % (step)", "most volatile layer (mean %)",
         "most churned expert (out %)", "mean rollout-train mismatch %"], [summary_row(r) for r in runs])
        + "<p class='note'>Flip rates, mismatch and churn in percent of top-k slots. Only routed experts of MoE "
        "layers count: dense layers and shared experts have no routing.</p>")

    pct = lambda x, y: (x, 100 * y)  # noqa: E731
    lines = [(r.label, *pct(*r.series(FLIP))) for r in have]
    dashed = [(f"{r.label} rollout-train mismatch", *pct(*r.series(MISMATCH))) for r in have]
    fig = line_plot(png("flip_rate"), lines, "Expert flip rate per step (all layers)", "% of top-k slots",
                    dashed=[d for d in dashed if len(d[1])])
    parts.append("<h2>Flip rate over training</h2>" + html.figure(
        fig.name, "Overall flip rate per step in percent, one line per run; dashed: rollout engine vs training "
                  "routing."))

    panels = [(r.label, *r.matrix(LAYER)) for r in have if r.indexed(LAYER)]
    panels = [(label, steps, ids, 100 * M) for label, steps, ids, M in panels]
    if panels:
        fig = heatmap_panels(png("heatmap"), panels, "Flip rate", "MoE layer", "flip rate, % of top-k slots")
        parts.append("<h2>Per layer</h2>" + html.figure(fig.name, "Flip rate per MoE layer (rows) and step (columns), "
                                                                  "in percent."))

    sources = []
    for r in have:
        means = {}
        for name, prefix in (("expert-bias update", BIAS), ("gradient", GRADIENT)):
            _, got, M = r.matrix(prefix)
            means[name] = {i: 100 * (np.nanmean(M[j]) if np.isfinite(M[j]).any() else 0.0)
                           for j, i in enumerate(got)}
        ids = sorted(set(means["expert-bias update"]) | set(means["gradient"]))
        if ids:
            sources.append((r.label, ids, {n: [m.get(i, 0.0) for i in ids] for n, m in means.items()}))
    if sources:
        fig = grouped_bars(png("sources"), sources, "Flips by source (mean over steps)", "MoE layer",
                           "% of top-k slots", dict(zip(("expert-bias update", "gradient"), PARTS)))
        parts.append("<h2>Expert bias and gradient</h2>" + html.figure(
            fig.name, "Per MoE layer, in percent of top-k slots: the flips the expert-bias updates alone caused (the "
                      "same live logits under the old policy's bias against the current one) and those the weight "
                      "updates caused (the live logits under the old bias against the old routing). Their sum can "
                      "exceed the flip rate: a slot one source flips the other may flip back."))

    bars, left_out = [], []
    for r in have:
        churn = {name: pooled_churn([churn_counts(r, prefix)])
                 for name, prefix in (("gained (in)", CHURN_IN), ("lost (out)", CHURN_OUT))}
        gone = sorted(set().union(*(o for _, o in churn.values())))
        ids = sorted({e for c, _ in churn.values() for e in c} | set(gone))
        if gone:
            left_out.append(f"{r.label}: expert {', '.join(map(str, gone))}")
        if ids:  # a left-out expert is a gap
            bars.append((r.label, ids, {n: [100 * c.get(e, np.nan) for e in ids] for n, (c, _) in churn.items()}))
    if bars:
        fig = grouped_bars(png("churn"), bars, "Per-expert churn (pooled over steps)", "expert",
                           "% of its old-routing slots", dict(zip(("gained (in)", "lost (out)"), PARTS)))
        parts.append("<h2>Per expert</h2>" + html.figure(
            fig.name, "Slots each expert gained and lost, in percent of the slots it held in the old routing of the "
                      "same tokens, both summed over layers and steps before dividing (an expert that held few "
                      f"slots at a step weighs little). Experts that held fewer than {MIN_CHURN_SLOTS} slots in all "
                      "are left out (a gap)" + (f" ({'; '.join(left_out)})" if left_out else "") + "."))

    out.write_text(html.page("Expert volatility", parts))
    return out
