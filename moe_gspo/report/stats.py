"""Statistics of a comparison over seeds: t-intervals, paired differences, smoothing and a collapse detector.

    final = final_value(rewards, window=10)                 # mean of the last 10 logged steps of one run
    ci = t_interval([0.52, 0.57, 0.61])                     # Interval(mean, lo, hi, n): 95% Student-t interval
    bounded(t_interval(flip_rates))                         # the same, cut to [0, 1]: a rate cannot leave it
    d = t_interval(np.subtract(gspo_finals, grpo_finals))   # paired by seed
    verdict("gspo", "grpo", d)                              # "not distinguishable at this budget" (covers 0)
    collapses(rewards, fraction=0.5, patience=10)           # [Collapse(start, peak, ...)]

The interval is the Student-t interval of a mean: mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard
deviation (ddof=1). It assumes the n seed-level values are independent draws of a roughly normal quantity; with
3-5 seeds it is wide, which is the honest answer at that budget. One seed gives no interval (lo = hi = None).
Values without spread (all equal: s = 0) give a zero-width interval, which measures no noise: a verdict drawn from
it says so (`Interval.missing`) instead of a direction.
Quantiles, p-values and power come from scipy.stats (t, ttest_1samp, fisher_exact, nct, binom); no I/O.

    paired_power(0.1, sd=0.2, n=8, alpha=0.05 / 4)          # power of a paired t-test at a Bonferroni level
    seeds_for_power(0.1, sd=0.2, alpha=0.05 / 4)            # the fewest seeds giving 80% power there
    fisher_power(0.5, 0.1, n=8)                             # power of Fisher's test on collapse counts
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats as st


def t_critical(df: int, level: float = 0.95) -> float:
    """The t such that P(|T| <= t) = level for Student's t with df degrees of freedom."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return float(st.t.ppf((1 + level) / 2, df))


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided t-interval; lo/hi are None for a single value (no spread to estimate)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    level: float = 0.95

    @property
    def missing(self) -> str | None:
        """Why the interval measures nothing ('1 seed', 'values not finite', 'no spread across seeds': lo = hi);
        None when it has a width."""
        if self.lo is None:
            return "1 seed"
        if not all(map(math.isfinite, (self.mean, self.lo, self.hi))):
            return "values not finite"
        return "no spread across seeds" if self.lo == self.hi else None

    def covers(self, x: float) -> bool | None:
        return None if self.lo is None else self.lo <= x <= self.hi

    def text(self, digits: int = 3) -> str:
        """'0.571 [0.52, 0.62]' or '0.571 (1 seed: no interval)'."""
        if self.lo is None:
            return f"{self.mean:.{digits}g} (1 seed: no interval)"
        return f"{self.mean:.{digits}g} [{self.lo:.{digits}g}, {self.hi:.{digits}g}]"


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of `values` with its Student-t interval (n - 1 degrees of freedom)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or not len(x):
        raise ValueError("t_interval needs a non-empty 1-D sequence of values")
    m = float(x.mean())
    if len(x) == 1:
        return Interval(m, None, None, 1, level)
    half = t_critical(len(x) - 1, level) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return Interval(m, m - half, m + half, len(x), level)


def bounded(iv: Interval, lo: float | None = 0.0, hi: float | None = 1.0) -> Interval:
    """`iv` with its ends cut to [lo, hi] (None: no bound on that side), the range the quantity cannot leave: the
    t-interval of the mean of rates in [0, 1] is symmetric and can reach below 0 or above 1 where the rates are near
    a bound, though their mean never can. The mean is left as it is."""
    if iv.lo is None:
        return iv
    return replace(iv, lo=float(np.clip(iv.lo, lo, hi)), hi=float(np.clip(iv.hi, lo, hi)))


def fisher_exact(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """Two-sided p-value of Fisher's exact test (scipy.stats.fisher_exact) on the 2x2 table
    [[hits_a, n_a - hits_a], [hits_b, n_b - hits_b]] (e.g. collapsed runs out of seeds, two variants): the
    probability, under the hypergeometric law of the first cell given both margins, of a table no more probable
    than the one observed."""
    if not (0 <= hits_a <= n_a and 0 <= hits_b <= n_b) or n_a + n_b == 0:
        raise ValueError(f"fisher_exact: bad counts {hits_a}/{n_a}, {hits_b}/{n_b}")
    return float(st.fisher_exact([[hits_a, n_a - hits_a], [hits_b, n_b - hits_b]]).pvalue)


def wilson(hits: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion hits/n (scipy.stats.binomtest's proportion_ci, method 'wilson')."""
    ci = st.binomtest(hits, n).proportion_ci(level, method="wilson")
    return float(ci.low), float(ci.high)


def newcombe(hits_a: int, n_a: int, hits_b: int, n_b: int, level: float = 0.95) -> Interval:
    """The difference of two independent proportions hits_a/n_a - hits_b/n_b with Newcombe's hybrid score
    interval (Newcombe 1998, method 10: each proportion's Wilson interval, combined in quadrature). For the same
    items measured twice it is conservative (their positive correlation narrows the true interval)."""
    pa, pb = hits_a / n_a, hits_b / n_b
    (la, ua), (lb, ub) = wilson(hits_a, n_a, level), wilson(hits_b, n_b, level)
    d = pa - pb
    return Interval(d, d - math.hypot(pa - la, ub - pb), d + math.hypot(ua - pa, pb - lb), n_a + n_b, level)


def paired_p(diffs: Sequence[float]) -> float | None:
    """Two-sided p-value of the paired t-test that the mean of `diffs` is 0 (scipy.stats.ttest_1samp on the
    per-pair differences, which is ttest_rel on the pairs); None below 2 values or with no spread."""
    x = np.asarray(diffs, dtype=float)
    if len(x) < 2 or float(x.std(ddof=1)) == 0:
        return None
    return float(st.ttest_1samp(x, 0.0).pvalue)


def paired_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level `alpha` with n pairs, when the true mean difference is
    `effect` and the per-pair differences have standard deviation `sd`: P(|T| > t_{1-alpha/2, n-1}) with T
    noncentral t (n - 1 degrees of freedom, noncentrality effect / sd * sqrt(n); scipy.stats.nct)."""
    if n < 2 or sd <= 0:
        raise ValueError(f"paired_power: n={n} must be >= 2 and sd={sd} > 0")
    df, nc = n - 1, effect / sd * math.sqrt(n)
    crit = st.t.ppf(1 - alpha / 2, df)
    return float(st.nct.sf(crit, df, nc) + st.nct.cdf(-crit, df, nc))


def seeds_for_power(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8, most: int = 10_000) -> int:
    """The fewest paired seeds whose paired_power(effect, sd, n, alpha) reaches `power`."""
    for n in range(2, most + 1):
        if paired_power(effect, sd, n, alpha) >= power:
            return n
    raise ValueError(f"seeds_for_power: more than {most} seeds for effect {effect} at sd {sd}, alpha {alpha}")


def fisher_power(rate_a: float, rate_b: float, n: int, alpha: float = 0.05) -> float:
    """Power of Fisher's two-sided exact test at level `alpha` comparing two counts out of n runs each (e.g.
    collapses), when each run of arm a collapses with probability rate_a and of arm b with rate_b, independently:
    the binomial probability of every pair of counts whose table has p < alpha (exact, (n + 1)^2 tables)."""
    k = np.arange(n + 1)
    pa, pb = st.binom.pmf(k, n, rate_a), st.binom.pmf(k, n, rate_b)
    return float(sum(pa[i] * pb[j] for i in k for j in k if fisher_exact(int(i), n, int(j), n) < alpha))


def band(rows: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Per column of rows (seeds, steps): (mean, lo, hi) of the t-interval across seeds; lo, hi None for 1 row."""
    rows = np.asarray(rows, dtype=float)
    mean = rows.mean(0)
    n = rows.shape[0]
    if n < 2:
        return mean, None, None
    half = t_critical(n - 1, level) * rows.std(0, ddof=1) / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(name: str, base: str, diff: Interval) -> str:
    """Plain words for the paired difference `name - base`: a direction only from an interval with a width that
    excludes 0."""
    if diff.lo is None:
        return "1 seed: no interval, cannot tell"
    if diff.missing:  # e.g. equal differences at every seed: a zero-width interval, no noise measured
        return f"not distinguishable at this budget ({diff.missing})"
    if diff.covers(0.0):
        return "not distinguishable at this budget"
    return f"{name} {'higher' if diff.mean > 0 else 'lower'} than {base}"


def final_value(values: Sequence[float], window: int) -> float:
    """Mean of the last `window` values (all of them when there are fewer)."""
    x = np.asarray(values, dtype=float)
    if not len(x):
        raise ValueError("final_value of an empty series")
    return float(x[-window:].mean())


def smooth(y: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average over up to `window` values (fewer at the start)."""
    y = np.asarray(y, dtype=float)
    c = np.cumsum(np.insert(y, 0, 0.0))  # c[i] = sum(y[:i])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


@dataclass(frozen=True)
class Collapse:
    """A collapse of one run: at index `start` the smoothed reward fell below `fraction * peak`, `peak` being its
    running maximum then, and stayed below that level for at least `patience` logged steps; `end` is the first
    index back at or above the level (None: it never recovered)."""

    start: int
    peak: float
    end: int | None


def collapses(values: Sequence[float], fraction: float = 0.5, patience: int = 10, min_peak: float = 0.1,
              window: int = 5, full_windows: bool = False) -> list[Collapse]:
    """Collapses of a reward series (one value per logged step), on its `window`-step trailing moving average.

    A collapse starts where the smoothed reward s_t drops below fraction * P_t (P_t = max of s up to t) and s stays
    below that level for `patience` consecutive values or until the series ends: a run that ends collapsed counts,
    however late the drop came. Only drops from a peak P_t >= `min_peak` count, so that noise around a reward that
    never rose above min_peak is not a collapse. A dip shorter than `patience` that recovers before the end is not a
    collapse. After a collapse that recovers (s back at or above its level), a later drop counts again.

    The moving average of the first window - 1 values averages fewer steps (step 1's alone at first), so a single
    lucky first reward can set the peak. full_windows=True lets only full windows set the peak and start a
    collapse (a sensitivity check of the rule in force, which is full_windows=False)."""
    if not 0 < fraction < 1:
        raise ValueError(f"collapse fraction={fraction} must be in (0, 1)")
    if patience < 1 or window < 1:
        raise ValueError(f"collapse patience={patience} and window={window} must be >= 1")
    s = smooth(values, window)
    out: list[Collapse] = []
    peak = -math.inf
    t = 0
    if full_windows:
        t = window - 1
    while t < len(s):
        peak = max(peak, s[t])
        level = fraction * peak
        if peak >= min_peak and s[t] < level:
            above = np.nonzero(s[t:] >= level)[0]
            end = t + int(above[0]) if len(above) else None
            if end is None or end - t >= patience:  # lasted `patience` values, or to the end of the run
                out.append(Collapse(t, float(peak), end))
            if end is None:
                break
            t = end  # the peak carries on from where the reward came back
            continue
        t += 1
    return out
