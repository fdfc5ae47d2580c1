"""Statistics of `moe-gspo compare`: Student-t intervals against textbook quantiles and a known distribution,
paired verdicts, and the collapse detector on constructed reward curves."""

from __future__ import annotations

import numpy as np
import pytest

from moe_gspo.report.stats import (band, collapses, final_value, fisher_power, paired_power, seeds_for_power, smooth,
                                   t_critical, t_interval, verdict)


@pytest.mark.parametrize("df,t95,t90", [(1, 12.706, 6.314), (2, 4.303, 2.920), (3, 3.182, 2.353), (4, 2.776, 2.132),
                                        (9, 2.262, 1.833), (29, 2.045, 1.699)])
def test_t_quantiles_match_the_tables(df, t95, t90):
    assert t_critical(df) == pytest.approx(t95, abs=1e-3)
    assert t_critical(df, 0.90) == pytest.approx(t90, abs=1e-3)


def test_t_quantile_tends_to_the_normal():
    assert t_critical(2000) == pytest.approx(1.96, abs=2e-3)


@pytest.mark.parametrize("n", [3, 5])
def test_interval_covers_a_known_mean_95_percent_of_the_time(n):
    """Seed-level values drawn from N(0.3, 0.2^2): the 95% t-interval holds 0.3 in about 95% of 4000 draws, while
    the normal-quantile interval (1.96) of the same draws covers clearly less at small n."""
    rng = np.random.default_rng(0)
    draws = rng.normal(0.3, 0.2, size=(4000, n))
    ivs = [t_interval(d) for d in draws]
    coverage = np.mean([iv.lo <= 0.3 <= iv.hi for iv in ivs])
    assert 0.935 <= coverage <= 0.965, coverage
    z = np.mean(np.abs(draws.mean(1) - 0.3) <= 1.96 * draws.std(1, ddof=1) / np.sqrt(n))
    assert z < coverage - 0.02, (z, coverage)
    assert all(iv.mean == pytest.approx(d.mean()) for iv, d in zip(ivs[:10], draws[:10]))


def test_one_value_has_no_interval():
    iv = t_interval([0.42])
    assert (iv.mean, iv.lo, iv.hi, iv.n) == (0.42, None, None, 1)
    assert "no interval" in iv.text() and iv.covers(0.0) is None
    assert verdict("gspo", "grpo", iv) == "1 seed: no interval, cannot tell"
    with pytest.raises(ValueError):
        t_interval([])


def test_paired_verdicts():
    rng = np.random.default_rng(1)
    grpo = rng.uniform(0.3, 0.7, size=5)  # seeds differ a lot; pairing removes that spread
    better = grpo + 0.05 + rng.normal(0, 0.005, size=5)
    same = grpo + rng.normal(0, 0.02, size=5)
    assert verdict("gspo", "grpo", t_interval(better - grpo)) == "gspo higher than grpo"
    assert verdict("x", "grpo", t_interval(grpo - better)) == "x lower than grpo"
    assert verdict("gspo", "grpo", t_interval(same - grpo)) == "not distinguishable at this budget"
    # unpaired, the seed-to-seed spread swamps the same 0.05 shift
    assert t_interval(better).covers(float(grpo.mean()))


def test_equal_differences_at_every_seed_give_no_direction(tmp_path):
    """Two seeds whose paired differences are equal (exactly, as dyadic rewards make them): their standard deviation
    is 0, so the t-interval has zero width, away from 0, and measures no noise. The verdict is the covers-0 one with
    the reason instead of "gspo lower than grpo", there is no p-value, and the terminal summary and the report's
    difference table print no bracket."""
    import json

    from moe_gspo.config import CompareConfig
    from moe_gspo.report.compare_data import diff_rows, load_variants, summary_lines, variant_stats
    from moe_gspo.report.stats import paired_p

    grpo = np.array([0.5, 0.25])
    gspo = grpo - 0.125
    d = t_interval(gspo - grpo)
    assert (d.mean, d.lo, d.hi, d.n) == (-0.125, -0.125, -0.125, 2) and not d.covers(0.0)
    assert d.missing == "no spread across seeds" and t_interval([0.1, 0.3]).missing is None
    assert verdict("gspo", "grpo", d) == "not distinguishable at this budget (no spread across seeds)"
    assert paired_p(gspo - grpo) is None
    assert verdict("x", "grpo", t_interval([float("nan"), 0.5])) == "not distinguishable at this budget (values not " \
                                                                       "finite)"

    for name, finals in (("grpo", grpo), ("gspo", gspo)):
        for seed, r in enumerate(finals):
            run = tmp_path / name / f"seed_{seed}"
            run.mkdir(parents=True)
            run.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": float(r)}) + "\n"
                                                             for s in range(1, 13)))
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": [], "gspo": []}, "seeds": [0, 1]}))
    variants = load_variants(tmp_path, ["grpo", "gspo"], [0, 1])
    base, stats = variant_stats(variants, CompareConfig())
    assert stats["gspo"].verdict == "not distinguishable at this budget (no spread across seeds)"
    assert diff_rows(variants, stats, base)[0][3] == "\u2014 (no spread across seeds)"
    line = next(ln for ln in summary_lines(tmp_path) if ln.startswith("gspo"))
    assert "-0.125 " in line and "not distinguishable at this budget (no spread across seeds)" in line, line
    assert "lower" not in line and "[-0.125" not in line, line


def test_bounded_cuts_an_interval_to_the_range_of_its_quantity():
    """Rates of 0.1%, 0.1% and 5%: the t-interval of their mean reaches below 0, which no rate can; bounded cuts it
    at 0 and leaves the mean and the other end. An upper bound cuts the same way, None leaves a side open, and one
    value (no interval) stays as it is."""
    from moe_gspo.report.stats import bounded

    iv = t_interval([0.001, 0.001, 0.05])
    assert iv.lo < 0 < iv.hi < 1
    cut = bounded(iv)
    assert (cut.mean, cut.lo, cut.hi, cut.n) == (iv.mean, 0.0, iv.hi, 3)
    high = t_interval([0.999, 0.999, 0.9])
    assert high.hi > 1 and bounded(high).hi == 1.0 and bounded(high).lo == high.lo
    assert bounded(high, None, None) == high and bounded(iv, 0.0, None).hi == iv.hi
    assert bounded(t_interval([0.5])) == t_interval([0.5])
    ratio = t_interval([1.0, 1.0, 1.3])
    assert ratio.lo < 1 and bounded(ratio, 1.0, None).lo == 1.0  # the load max/mean is >= 1


def test_band_across_seeds():
    rows = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]])
    mean, lo, hi = band(rows)
    assert mean.tolist() == [2.0, 1.0]
    assert hi[0] - mean[0] == pytest.approx(t_critical(2) * 2.0 / np.sqrt(3))
    assert lo[1] == hi[1] == 1.0
    assert band(rows[:1])[1] is None


def test_final_value_and_smoothing():
    assert final_value([0, 0, 1, 2, 3], 3) == 2.0
    assert final_value([5.0], 10) == 5.0
    assert smooth([0, 2, 4, 6], 2).tolist() == [0, 1, 3, 5]


def _curve(*pieces):
    return np.concatenate([np.full(n, v, dtype=float) for n, v in pieces])


def test_collapse_detector_on_constructed_curves():
    # rises to 0.6, then falls to 0.05 for good: one collapse, never recovered
    rise = np.linspace(0.2, 0.6, 20)
    c = collapses(np.concatenate([rise, np.full(30, 0.05)]), fraction=0.5, patience=10, window=5)
    assert len(c) == 1 and c[0].end is None and c[0].peak == pytest.approx(rise[-5:].mean())  # smoothed peak
    assert 20 <= c[0].start <= 24  # the 5-step average crosses 0.3 within the window after the drop
    # the same drop lasting 6 steps, then back: a dip, not a collapse
    assert collapses(_curve((20, 0.6), (6, 0.05), (30, 0.6)), patience=10, window=1) == []
    # ... but with patience 5 it is one, recovered where the reward returns
    dip = collapses(_curve((20, 0.6), (6, 0.05), (30, 0.6)), patience=5, window=1)
    assert [(d.start, d.end) for d in dip] == [(20, 26)]
    # flat curves: at 0.5, and at 0 (below min_peak) with noise
    assert collapses(np.full(60, 0.5)) == []
    assert collapses(np.random.default_rng(0).uniform(0, 0.05, 60), min_peak=0.1) == []
    # a drop in the last steps that lasts to the end: the run ends collapsed, however late
    late = collapses(_curve((40, 0.6), (5, 0.0)), patience=10, window=1)
    assert [(d.start, d.end) for d in late] == [(40, None)]
    # a dip in the last steps that recovers before the end is still a dip
    assert collapses(_curve((40, 0.6), (3, 0.0), (2, 0.6)), patience=10, window=1) == []
    # a run that never rose to min_peak cannot collapse, even from 0.08 to 0
    assert collapses(_curve((20, 0.08), (30, 0.0)), patience=10, window=1, min_peak=0.1) == []
    # two collapses with a recovery in between
    two = collapses(_curve((10, 0.5), (12, 0.1), (10, 0.5), (15, 0.0)), patience=10, window=1)
    assert [(d.start, d.end) for d in two] == [(10, 22), (32, None)]
    with pytest.raises(ValueError, match="fraction"):
        collapses([0.1], fraction=1.5)


def test_a_lucky_first_step_sets_the_peak_unless_only_full_windows_count():
    """Step 1's reward alone is the first moving average: at 0.9 then 0.3 for good, the rule in force finds a
    collapse from that one value; with peaks from full windows only (a sensitivity check) there is none."""
    y = _curve((1, 0.9), (39, 0.3))
    assert [c.peak for c in collapses(y, window=5)] == [pytest.approx(0.9)]
    assert collapses(y, window=5, full_windows=True) == []
    # a real rise and fall is found either way, at the same step
    rise_fall = np.concatenate([np.linspace(0.2, 0.6, 20), np.full(30, 0.05)])
    assert [c.start for c in collapses(rise_fall, full_windows=True)] == [c.start for c in collapses(rise_fall)]


def test_fisher_exact_matches_published_values():
    """Fisher's tea-tasting table [[3, 1], [1, 3]]: two-sided p = 34/70 = 0.4857 (Fisher 1935; Agresti, Categorical
    Data Analysis, 3rd ed., sec. 3.5.1); [[0, 8], [5, 3]] (0/8 against 5/8): 2 * C(8,5) / C(16,5) = 0.02564."""
    from moe_gspo.report.stats import fisher_exact

    assert abs(fisher_exact(3, 4, 1, 4) - 34 / 70) < 1e-12
    assert abs(fisher_exact(0, 8, 5, 8) - 2 * 56 / 4368) < 1e-12
    assert fisher_exact(3, 8, 3, 8) == 1.0
    assert fisher_exact(1, 8, 3, 8) == fisher_exact(3, 8, 1, 8)  # symmetric in the two rows


def test_paired_p_matches_the_t_interval():
    """The paired p-value is below 0.05 exactly when the 95% interval of the mean difference excludes 0."""
    import numpy as np

    from moe_gspo.report.stats import paired_p

    rng = np.random.default_rng(0)
    for shift in (0.0, 0.2, 0.5, 1.0):
        d = rng.normal(shift, 1.0, size=8)
        iv = t_interval(d)
        assert (paired_p(d) < 0.05) == (not iv.covers(0.0))
    assert paired_p([1.0]) is None


def test_study_summary_contrasts_recomputes_the_committed_vllm_study():
    """scripts/study_summary.py contrasts on the committed raw data (docs/results/vllm/runs): each contrast's per-seed
    values are the final rewards (mean of the last 10 steps) of the two variants' runs subtracted seed by seed, its
    interval the t-interval of those, and its Bonferroni interval is wider by t(1 - 0.05/(2m)) / t(0.975)."""
    import json
    import subprocess
    import sys

    from helpers import ROOT
    from moe_gspo.report.stats import t_critical

    runs = ROOT / "docs/results/vllm/runs"
    out = subprocess.run([sys.executable, str(ROOT / "scripts/study_summary.py"), "contrasts", str(runs), "gspo-grpo",
                          "grpo_r3-grpo", "gspo-grpo/grpo_r3-grpo", "--json", "/dev/stdout"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    got = json.loads(out[out.index("{"):])

    def final(variant, seed):
        rows = [json.loads(x) for x in (runs / variant / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()]
        return float(np.mean([r["reward/mean"] for r in rows[-10:]]))

    seeds = range(8)
    d1 = [final("gspo", s) - final("grpo", s) for s in seeds]
    d2 = [final("grpo_r3", s) - final("grpo", s) for s in seeds]
    for spec, want in (("gspo-grpo", d1), ("gspo-grpo/grpo_r3-grpo", [a - b for a, b in zip(d1, d2)])):
        c = got["contrasts"][spec]
        assert [c["per_seed"][str(s)] for s in seeds] == pytest.approx(want, abs=1e-12)
        half = t_critical(7, 0.95) * np.std(want, ddof=1) / np.sqrt(8)
        assert c["ci95"] == pytest.approx([np.mean(want) - half, np.mean(want) + half], abs=1e-12)
        wide = (c["bonferroni"][1] - c["bonferroni"][0]) / (c["ci95"][1] - c["ci95"][0])
        assert wide == pytest.approx(t_critical(7, 1 - 0.05 / 3) / t_critical(7, 0.95), rel=1e-9)
    assert got["family_size"] == 3 and got["collapsed"]["gspo"] == 0


def test_study_summary_steps_gives_each_variants_mean_reward_per_step():
    """scripts/study_summary.py steps on committed raw data (docs/results/router_volatility_s100/runs): each cell is
    the mean over the variant's seeds of that step's reward/mean."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    runs = ROOT / "docs/results/router_volatility_s100/runs"
    out = subprocess.run([sys.executable, str(ROOT / "scripts/study_summary.py"), "steps", str(runs), "--first", "2",
                          "--last", "4"], capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| variant") and "---" not in line}
    assert set(rows) == {"grpo", "grpo_r2", "grpo_r3", "grpo_s1", "gspo"}
    for variant in ("gspo", "grpo_s1"):
        seeds = sorted((runs / variant).glob("seed_*"))
        for col, step in enumerate((2, 3, 4)):
            vals = [r["reward/mean"] for d in seeds for r in map(json.loads, (d / "metrics.jsonl").read_text()
                                                                  .splitlines()) if r["step"] == step]
            assert rows[variant][1] == str(len(seeds)) and len(vals) == len(seeds)
            assert float(rows[variant][2 + col]) == pytest.approx(np.mean(vals), abs=5e-4)


def test_study_summary_regime_recomputes_the_committed_offpolicy_depth_study():
    """scripts/study_summary.py regime on committed raw data (docs/results/offpolicy_depth/runs): a run's clip
    fraction and flip rate are means over its steps where some group had reward variance, its ratio_max the largest
    logged, its step-1 reward the first step's; recomputed here from metrics.jsonl."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    runs = ROOT / "docs/results/offpolicy_depth/runs"
    out = subprocess.run([sys.executable, str(ROOT / "scripts/study_summary.py"), "regime", str(runs), "--json",
                          "/dev/stdout"], capture_output=True, text=True, timeout=300, check=True).stdout
    got = json.loads(out[out.index("\n{") + 1:])
    for variant in ("grpo_mb32", "gspo_mb8"):
        for seed in range(8):
            rows = [json.loads(x) for x in (runs / variant / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()]
            grad = [r for r in rows if r["groups/with_variance"] > 0]
            g = got[variant]
            assert g["clipfrac"][seed] == pytest.approx(np.mean([r["pg_clipfrac"] for r in grad]), rel=1e-12)
            assert g["flip_rate"][seed] == pytest.approx(np.mean([r["moe/flip_rate"] for r in grad]), rel=1e-12)
            assert g["ratio_max"][seed] == max(r["ratio_max"] for r in rows)
            assert g["step1_reward"][seed] == rows[0]["reward/mean"]
            assert g["steps_with_gradient"][seed] == len(grad)
    assert sum(got["grpo_mb32"]["collapsed"]) == 1


def test_study_summary_volatility_gives_the_study_table_from_the_committed_cut_metrics():
    """The committed volatility study (docs/results/volatility/runs) keeps only the exported keys of each run; from
    those, scripts/study_summary.py volatility gives every point's flip rate, seed range, first and last layer and
    reward as the study's own study_table.csv (written from the full metrics when it ran)."""
    import csv
    import subprocess
    import sys

    from helpers import ROOT

    runs = ROOT / "docs/results/volatility/runs"
    out = subprocess.run([sys.executable, str(ROOT / "scripts/study_summary.py"), "volatility", str(runs)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    printed = {(r[0], r[1], r[2]): r for r in (ln.strip("| ").split(" | ") for ln in out.splitlines()[3:])}
    table = list(csv.DictReader((runs / "study_table.csv").open()))
    assert len(table) == len(printed) == 13
    for t in table:
        r = printed[(t["layers"], f"{float(t['lr']):g}", t["minibatches"])]
        assert r[5] == f"{100 * float(t['flip_rate']):.2f}"
        assert r[6] == f"{100 * float(t['seed_min']):.2f} - {100 * float(t['seed_max']):.2f}"
        assert (r[7], r[8]) == (f"{100 * float(t['first_layer']):.2f}", f"{100 * float(t['last_layer']):.2f}")
        assert r[9] == f"{float(t['reward']):.2f}"


def test_paired_power_matches_cohen_and_a_simulation():
    """A paired t-test with effect size d = 0.5 needs 34 pairs for 80% power at two-sided alpha 0.05 (Cohen 1988,
    table 2.4.1, as G*Power gives it); and the computed power at 8 seeds, effect 0.1, sd 0.2 and a Bonferroni level
    equals the rejection rate of ttest_1samp over 20000 simulated studies."""
    from scipy import stats as st

    assert seeds_for_power(0.5, 1.0) == 34
    assert paired_power(0.5, 1.0, 33) < 0.8 <= paired_power(0.5, 1.0, 34)
    rng = np.random.default_rng(0)
    d = rng.normal(0.1, 0.2, size=(20000, 8))
    hits = float(np.mean(st.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05 / 4))
    assert paired_power(0.1, 0.2, 8, 0.05 / 4) == pytest.approx(hits, abs=0.01)
    assert paired_power(0.0, 0.2, 8) == pytest.approx(0.05, abs=1e-9)  # no effect: the test's own level


def test_fisher_power_matches_a_simulation():
    """Power of Fisher's test on collapse counts, 8 runs per arm at rates 0.5 and 0.125: the exact sum over the 81
    tables equals the rejection rate of fisher_exact over 4000 simulated pairs of counts."""
    from moe_gspo.report.stats import fisher_exact

    rng = np.random.default_rng(1)
    a, b = rng.binomial(8, 0.5, 4000), rng.binomial(8, 0.125, 4000)
    hits = np.mean([fisher_exact(int(x), 8, int(y), 8) < 0.05 for x, y in zip(a, b)])
    assert fisher_power(0.5, 0.125, 8) == pytest.approx(hits, abs=0.02)


@pytest.mark.parametrize("a,b,lo,hi", [((56, 70), (48, 80), 0.0524, 0.3339), ((9, 10), (3, 10), 0.1705, 0.8090),
                                       ((5, 56), (0, 29), -0.0381, 0.1926)])
def test_newcombe_matches_newcombe_1998s_table(a, b, lo, hi):
    """Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10 (score, no continuity correction)."""
    from moe_gspo.report.stats import newcombe, wilson

    d = newcombe(*a, *b)
    assert d.mean == pytest.approx(a[0] / a[1] - b[0] / b[1])
    assert (round(d.lo, 4), round(d.hi, 4)) == (lo, hi)
    p, (wl, wh) = 48 / 80, wilson(48, 80)  # Wilson's bounds solve |p - p^| = z sqrt(p (1 - p) / n)
    for bound in (wl, wh):
        assert abs(p - bound) == pytest.approx(1.959964 * (bound * (1 - bound) / 80) ** 0.5, rel=1e-5)
