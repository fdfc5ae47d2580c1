"""Every statistics table printed from the committed studies (docs/results/) by scripts/study_summary.py and the
comparison summary, recomputed here from the raw metrics with today's moe_gspo/report/stats.py, prints the same
text as tests/golden/stats_tables.txt, which the hand-written t-quantile, t-CDF and Fisher code wrote before
scipy.stats replaced it (tests/golden/stats_tables.py makes both)."""

from __future__ import annotations

import difflib
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
import stats_tables  # noqa: E402


def test_committed_tables_print_the_same_digits():
    want = stats_tables.parse(stats_tables.GOLDEN.read_text())
    got = stats_tables.tables()
    assert set(got) == set(want)
    diffs = {k: "".join(difflib.unified_diff(want[k].splitlines(True), got[k].splitlines(True)))
             for k in want if got[k] != want[k]}
    assert not diffs, "\n".join(f"{k}:\n{d}" for k, d in diffs.items())
