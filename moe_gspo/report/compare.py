"""The comparison report: DIR/report.html from the variant runs DIR/<name>/metrics.jsonl of `moe-gspo compare`.

    write_compare_report("runs/compare", ["grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_token"], walls)
    python -m moe_gspo.report.compare DIR            # re-draw from existing runs

Figures (PNG next to the HTML): reward and accuracy curves, clip fractions on a log scale, the expert flip rate per
step and per layer (the volatility report's figures, moe_gspo/report/volatility.py), rollout-vs-train routing
mismatch and log-prob difference; and a summary table. Reads only the JSONL metrics.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_gspo.report import html
from moe_gspo.report.plots import Run, _save, colors, load_runs, plt
from moe_gspo.report.volatility import write_volatility_report

REWARD, ACC, CLIP, CLIP_LO, FLIP = "reward/mean", "accuracy", "pg_clipfrac", "pg_clipfrac_lower", "moe/flip_rate"
MISMATCH, PDIFF = "moe/rollout_train_mismatch", "rollout_probs_diff_mean"


def _mean(run: Run, key: str, last: int | None = None) -> float | None:
    _, v = run.series(key)
    if last:
        v = v[-last:]
    return float(v.mean()) if len(v) else None


STYLES = ["-", "--", "-.", ":", (0, (6, 2, 1, 2))]  # distinct dashes: identical runs overlap visibly


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over up to `window` steps (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))  # c[i] = sum(y[:i])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def curves(path: Path, runs: Sequence[Run], key: str, title: str, ylabel: str, window: int = 5,
           log: bool = False) -> Path:
    """One line per run (its own dash style), raw values faint and a `window`-step moving average bold.

    On a log axis, zeros are left out (gaps) and counted in the legend."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, (r, c) in enumerate(zip(runs, colors(len(runs)))):
        x, y = r.series(key)
        if not len(x):
            continue
        label = r.label
        if log:
            zeros = int((y <= 0).sum())
            label += f" ({zeros} steps at 0)" if zeros else ""
            y = np.where(y > 0, y, np.nan)
        ls = STYLES[i % len(STYLES)]
        if window > 1 and len(y) > window and not log:
            ax.plot(x, y, color=c, lw=0.8, alpha=0.3, ls=ls)
            ax.plot(x, smooth(y, window), color=c, lw=2.0, ls=ls, label=f"{label} ({window}-step mean)")
        else:
            ax.plot(x, y, color=c, lw=1.6, ls=ls, marker="o" if len(x) < 30 else None, ms=3, label=label)
    if log:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def summary_rows(runs: Sequence[Run], walls: dict[str, float], last: int = 10) -> list[list]:
    base = next((r for r in runs if r.label == "grpo"), None)
    base_clip = _mean(base, CLIP) if base is not None else None
    rows = []
    for r in runs:
        clip = _mean(r, CLIP)
        ratio = clip / base_clip if clip is not None and base_clip else None
        _, rew = r.series(REWARD)
        tail = rew[-last:]
        se = float(tail.std(ddof=1) / np.sqrt(len(tail))) if len(tail) > 1 else None
        rows.append([r.label, len(r.records), float(rew[0]) if len(rew) else None, _mean(r, REWARD, last), se,
                     _mean(r, ACC, last), clip, ratio, _mean(r, FLIP), _mean(r, MISMATCH), _mean(r, PDIFF),
                     walls.get(r.label)])
    return rows


def identical_pairs(runs: Sequence[Run], key: str) -> list[tuple[str, str]]:
    """Pairs of runs whose `key` series are exactly equal (and non-empty)."""
    out = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            (xa, ya), (xb, yb) = a.series(key), b.series(key)
            if len(ya) and np.array_equal(xa, xb) and np.array_equal(ya, yb):
                out.append((a.label, b.label))
    return out


HEADER = ["variant", "steps", "reward, step 1", "final reward (mean of last 10 steps)", "\u00b1 s.e.",
          "final accuracy (last 10)",
          "mean pg_clipfrac", "clip fraction / GRPO's", "mean flip rate", "mean rollout-train mismatch",
          "mean rollout_probs_diff", "wall time (s)"]


def write_compare_report(out_dir: str | Path, names: Sequence[str], walls: dict[str, float] | None = None,
                         cold_start_seconds: float | None = None) -> Path:
    out = Path(out_dir)
    runs = load_runs([out / n for n in names])
    walls = dict(walls or {})
    for r in runs:  # wall times from the run dirs when not given (re-drawing a finished comparison)
        wt = r.dir / "wall_time.json"
        if r.label not in walls and wt.is_file():
            walls[r.label] = json.loads(wt.read_text())["seconds"]
    png = lambda name: out / f"compare_{name}.png"  # noqa: E731
    parts = [f"<p class='note'>Variants: {html.esc(', '.join(names))}; same cold-started weights, prompts and "
             "sampling seeds. GRPO uses the token-level ratio with clip (0.2, 0.27); GSPO the length-normalized "
             "sequence ratio with clip (3e-4, 4e-4) unless the config overrides them. R2 replays the training "
             "engine's old routing, R3 the rollout engine's."
             + (f" Cold start took {cold_start_seconds:.0f} s." if cold_start_seconds else "") + "</p>"]
    parts.append("<h2>Summary</h2>" + html.table(HEADER, summary_rows(runs, walls)))
    same = identical_pairs(runs, REWARD)
    if same:
        parts.append("<p class='note'>Identical reward curves (the variants computed the same thing here, e.g. R2 and "
                     "R3 when the rollout engine routes exactly like the trainer): "
                     + html.esc(", ".join(f"{a} = {b}" for a, b in same)) + ".</p>")
    parts.append("<p class='note'>pg_clipfrac is the fraction of response tokens on the clipped branch (for GSPO: "
                 "tokens of clipped sequences). The GSPO paper reports about 100x more clipping for GSPO than GRPO "
                 "(~15% vs ~0.13%) with better training reward; a tiny model trained for a few steps need not "
                 "reproduce that.</p>")

    figs = [
        (curves(png("reward"), runs, REWARD, "Training reward (mean over the rollout batch)", "reward"),
         "Mean reward of each step's rollouts: faint raw, bold 5-step moving average. Curves of variants that "
         "compute the same thing (e.g. GSPO and GSPO-token) lie on top of each other."),
        (curves(png("accuracy"), runs, ACC, "Accuracy of sampled responses", "fraction with reward 1"),
         "Fraction of sampled responses that are correct (faint raw, bold 5-step moving average)."),
        (curves(png("clipfrac"), runs, CLIP, "Clip fraction (log scale)", "pg_clipfrac", log=True),
         "Fraction of response tokens on the clipped branch per step (GSPO: tokens of clipped sequences); "
         "steps with nothing clipped are gaps."),
        (curves(png("mismatch"), runs, MISMATCH, "Rollout engine vs training engine routing (old policy)",
                "fraction of top-k slots differing"),
         "Set-wise routing mismatch of rollout tokens between the rollout engine and the megatron training "
         "forward at the same weights (bold: 5-step moving average)."),
        (curves(png("probs_diff"), runs, PDIFF, "Rollout vs recomputed token probabilities (log scale)",
                "mean |p_engine - p_train|", log=True),
         "Mean absolute difference of response-token probabilities, rollout engine vs training engine."),
    ]
    parts.append("<h2>Reward and accuracy</h2>" + "".join(html.figure(f.name, c) for f, c in figs[:2]))
    parts.append("<h2>Clipping</h2>" + html.figure(figs[2][0].name, figs[2][1]))
    try:
        vol = write_volatility_report([r.dir for r in runs], out / "volatility.html")
        parts.append("<h2>Expert volatility</h2><p class='note'>From the volatility report "
                     f"(<a href='{vol.name}'>{vol.name}</a>): flip rate of the same rollout tokens' experts "
                     "between the old policy and the policy being trained, per step and per layer.</p>"
                     + html.figure(f"{vol.stem}_flip_rate.png", "Flip rate per step (all MoE layers)")
                     + html.figure(f"{vol.stem}_heatmap.png", "Flip rate per layer and step"))
    except ValueError as e:  # no flip metrics (track_flips off)
        parts.append(f"<h2>Expert volatility</h2><p class='note'>{html.esc(e)}</p>")
    parts.append("<h2>Rollout vs training</h2>" + "".join(html.figure(f.name, c) for f, c in figs[3:]))
    report = out / "report.html"
    report.write_text(html.page("GSPO vs GRPO on an MoE policy", parts))
    return report
