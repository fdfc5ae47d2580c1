"""The comparison report: DIR/report.html from the runs DIR/<variant>/seed_<s>/metrics.jsonl of `moe-gspo compare`.

    write_compare_report("runs/compare", ["grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_token"])
    moe-gspo report compare DIR                      # re-draw from existing runs

The seeds and the statistics settings (final window, smoothing, collapse rule) come from DIR/compare.json when it
is there (CompareConfig defaults otherwise; a variant directory holding metrics.jsonl itself is one run).
Statistics (moe_gspo/report/stats.py): a run's final reward is the mean of its last `final_window` steps; a
variant's is the mean over seeds with a 95% Student-t interval; each variant is compared with GRPO (or the first
variant when GRPO is absent) by the per-seed paired difference of final rewards, with its t-interval and a verdict;
collapses are counted per run. A run-settings table comes first (compare_settings.py: each variant's first run's
config.yaml: model family and shape, shared experts, grouped routing, attention, task, steps, batch, lr,
minibatches, the router's bias update rate, the clip range the loss actually used, replay, seeds). Flip rates and
routing mismatch are in percent everywhere, and intervals of rates are cut to [0, 100]. Figures (PNG next to the
HTML), every per-step curve drawn the same way (the mean over seeds faint, its trailing moving average bold, legends
outside the axes), each variant in one color throughout: reward (and accuracy only where it differs from the
reward), each variant's seeds with the 95% t-band, clip fractions on a log scale, the expert flip rate per step, the
flip rate per MoE layer (t-band across seeds), its split into the expert-bias update's and the gradient's flips
(with a table), per-expert churn, the first seed's layer x step heatmaps, rollout-vs-train routing mismatch and
probability difference. Reads the JSONL metrics, each run's config.yaml and compare.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_gspo.report import html
from moe_gspo.report.compare_data import (ACC, CLIP, DIFF_HEADER, LOAD_HEADER, LOAD_RATIO, METRIC_HEADER, MISMATCH,
                                          PDIFF, REWARD, RUN_HEADER, SUMMARY_HEADER, TURN_HEADER, diff_rows,
                                          identical_variants, load_rows, load_variants, metric_rows, read_meta,
                                          run_rows, run_walls, summary_rows, turn_rows, variant_stats)
from moe_gspo.report.compare_figures import mean_curves, seed_panels, volatility_section
from moe_gspo.report.compare_settings import settings_tables
from moe_gspo.report.stats import smooth


def write_compare_report(out_dir: str | Path, names: Sequence[str], walls: dict[str, float] | None = None,
                         cold_start_seconds=None) -> Path:
    """Write DIR/report.html and its PNGs from the runs of `names`; returns the HTML path. `walls`: seconds per run
    label ('grpo/seed_0'), else read from each run's wall_time.json."""
    out = Path(out_dir)
    meta, settings = read_meta(out)
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
                     "updates). Flip rates, churn, expert load and routing mismatch count the routed experts of the "
                     "MoE layers only: dense layers and shared experts have no routing, so they are excluded.</p>")
    parts.append("<h2>Summary</h2>" + html.table(SUMMARY_HEADER, summary_rows(variants, stats, base, walls),
                                                      numeric=True))
    parts.append(
        "<p class='note'>Per variant, means over seeds: the reward at step 1, the final reward and its interval, "
        "pg_clipfrac (its ratio to the baseline's), the flip rate and the engine mismatch (the rollout engine's "
        "routing against the trainer's) in percent of top-k slots, the mean |p_engine \u2212 p_train| of response "
        "tokens (each a run's mean over its steps); the wall time is summed over seeds. "
        f"Final reward: the mean training reward of a run's last {settings.final_window} steps; per "
        "variant, the mean over seeds with its 95% Student-t interval (mean \u00b1 t<sub>0.975, n\u22121</sub> "
        "\u00b7 s / \u221an over the n seeds' final rewards). A run collapses when its "
        f"{settings.smooth_window}-step moving-average reward falls below {settings.collapse_fraction:g} of its "
        f"running peak and stays below for at least {settings.collapse_patience} steps or until the run ends; only "
        f"drops from a peak of at least {settings.collapse_min_peak:g} count.</p>")
    drows = diff_rows(variants, stats, base)
    if drows:
        parts.append(f"<h2>Each variant vs {html.esc(base)}</h2>" + html.table(DIFF_HEADER, drows)
                     + f"<p class='note'>Per seed, the variant's final reward minus {html.esc(base)}'s at the same "
                     "seed (same cold start, same prompts); the interval is the Student-t interval of these "
                     "differences. An interval that covers 0 reads \u201cnot distinguishable at this budget\u201d: "
                     "more seeds or steps could still separate them. So does a difference that is the same at "
                     "every seed: without spread across seeds there is no interval to judge it by. Collapse counts "
                     "are compared by Fisher's exact two-sided test. These are per-comparison figures; with several "
                     "comparisons, a claim needs the family's correction (docs/guide/training.md, one "
                     "multiple-comparison policy).</p>")
    parts.append("<h2>Clipping, expert volatility and engine mismatch</h2>"
                 + html.table(METRIC_HEADER, metric_rows(variants, base))
                 + "<p class='note'>Each run's mean over its steps (the clip fraction and the flip rate over the "
                 "steps where some group had reward variance: a step without one has no gradient, so it clips "
                 "nothing and no expert moves; a run with no such step is left out); per variant, the mean over "
                 "seeds and its 95% Student-t interval, cut to the range the quantity cannot leave ([0, 1] for a "
                 "fraction, [0, 100] in percent). The clip-fraction ratio is taken per seed "
                 f"against {html.esc(base)} and averaged on the log scale (geometric mean; the interval is exp of "
                 "the t-interval of the log-ratios).</p>")
    if any(len(r.series(LOAD_RATIO)[0]) for v in variants for r in v.runs):
        parts.append("<h2>Expert load</h2>" + html.table(LOAD_HEADER, load_rows(variants))
                     + "<p class='note'>The old policy's routing of the response tokens each step trained on: per "
                     "MoE layer, each expert's share of the routed top-k slots; max/mean is the largest share times "
                     "the number of experts E (1 = balanced), the entropy is that of the shares in nats over ln E "
                     "(1 = balanced, 0 = one expert). A run's value is its mean over steps with gradient; per "
                     "variant, the mean over seeds with its 95% Student-t interval, cut to the range of the quantity "
                     "(max/mean >= 1, entropy in [0, 1]; the whole-model columns average the layers). The flip rate "
                     "is repeated from the table above.</p>")
    trows = turn_rows(variants)
    if trows:
        parts.append("<h2>Multi-turn episodes, by turn</h2>" + html.table(TURN_HEADER, trows, numeric=True)
                     + "<p class='note'>Episodes with tool calls (rollout.tools): per assistant turn t (0 first), "
                     "the sampled tokens of turn t and the tool and template tokens after it, per episode; the flip "
                     "rate and the rollout engine's routing mismatch on turn t's sampled tokens, in percent of "
                     "routed slots. A run's value is its mean over the steps that logged it; per variant, the mean "
                     "over seeds.</p>")
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
                     "% of top-k slots differing", w, scale=100),
         f"Set-wise routing mismatch of rollout tokens between the rollout engine and the megatron training "
         f"forward at the same weights, in percent of top-k slots ({smooth_text})."),
        (mean_curves(png("probs_diff"), variants, PDIFF, "Rollout vs recomputed token probabilities (log scale)",
                     "mean |p_engine - p_train|", w, log=True),
         f"Mean absolute difference of response-token probabilities, rollout engine vs training engine "
         f"({smooth_text})."),
    ]
    parts.append("<h2>Rollout vs training</h2>" + "".join(html.figure(f.name, c) for f, c in engine))
    report = out / "report.html"
    report.write_text(html.page("GSPO vs GRPO on an MoE policy", parts))
    return report
