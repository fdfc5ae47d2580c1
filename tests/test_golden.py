"""The golden curves: today's tiny RL runs against the per-step metrics stored in tests/golden/, so that a commit
that changes what training computes fails here instead of drifting unnoticed.

One test per golden (tests/golden/make.py lists them: GSPO, GRPO + R3 + truncated IS against a bf16 engine, packed
micro-batches, GSPO in bypass mode with rejection). A change meant to alter training refreshes the files on purpose:
`python tests/golden/make.py`, with the reason in the commit message (docs/guide/training.md, "The golden curves").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from make import GOLDENS, environment, golden_run, path  # noqa: E402

REL, ABS = 1e-5, 1e-7  # far above run-to-run rounding on one machine (0), far below any change to the math
# diagnostics added after curves were stored (they change nothing the run computes): a stored curve may lack them,
# and is compared on the keys it has; a curve written since holds them and is compared on them too
ADDED_SINCE = {"moe/rollout_train_token_mismatch"}
# the flip rate by updates since pi_old (one key per depth), and the flip rate by expert set (overall, per layer, per
# depth)
ADDED_SINCE_PREFIXES = ("moe/flip_rate/after_", "moe/set_flip_rate")


def _first_departure(rows, stored) -> str | None:
    if len(rows) != len(stored):
        return f"{len(rows)} steps against {len(stored)}"
    for step, (got, want) in enumerate(zip(rows, stored), start=1):
        got = {k: v for k, v in got.items()
               if k in want or (k not in ADDED_SINCE and not k.startswith(ADDED_SINCE_PREFIXES))}
        if set(got) != set(want):
            return f"step {step}: keys {sorted(set(got) ^ set(want))}"
        off = {k: (want[k], v) for k, v in got.items() if v != pytest.approx(want[k], rel=REL, abs=ABS)}
        if off:
            return f"step {step} left the golden curve: {off}"
    return None


@pytest.mark.parametrize("name", list(GOLDENS))
def test_the_tiny_run_follows_the_golden_curve(name):
    """The run equals this CPU environment's stored curve (tests/golden/make.py: environment); a CPU whose
    environment name matches a stored one but whose kernels differ from it passes if it equals another stored
    environment's curve, and a CPU with none of its own is skipped unless it equals one."""
    stored = {p.name.split(".")[1]: json.loads(p.read_text())["steps"]
              for p in sorted(path(name).parent.glob(f"train_tiny_{name}.*.json"))}
    assert stored, f"no golden curve for {name}: python tests/golden/make.py {name}"
    rows = golden_run(name)
    departures = {env: _first_departure(rows, curve) for env, curve in stored.items()}
    if any(d is None for d in departures.values()):
        return
    mine = environment()
    if mine not in stored:
        pytest.skip(f"no golden curve for this CPU ({mine}; stored: {', '.join(stored)}), and it equals none of "
                    f"them: python tests/golden/make.py writes its own")
    raise AssertionError(f"{name}: {departures[mine]} (and equals no other stored environment's curve)")
