"""The golden curves: today's tiny RL runs against the per-step metrics stored in tests/golden/, so that a commit
that changes what training computes fails here instead of drifting unnoticed.

One test per golden (tests/golden/make.py lists them: GSPO, GRPO + R3 + truncated IS against a bf16 engine, packed
micro-batches, GSPO in bypass mode with rejection). A change meant to alter training refreshes the files on purpose:
`python tests/golden/make.py`, with the reason in the commit message (docs/training.md, "The golden curves").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from make import GOLDENS, environment, golden_run, path  # noqa: E402

REL, ABS = 1e-5, 1e-7  # far above run-to-run rounding on one machine (0), far below any change to the math


@pytest.mark.parametrize("name", list(GOLDENS))
def test_the_tiny_run_follows_the_golden_curve(name):
    if not path(name).exists():  # the curves are the CPU's own (tests/golden/make.py: environment)
        known = sorted({p.name.split(".")[1] for p in path(name).parent.glob("train_tiny_*.json")})
        pytest.skip(f"no golden curve for this CPU ({environment()}; stored: {', '.join(known)}): "
                    f"python tests/golden/make.py writes them")
    stored = json.loads(path(name).read_text())["steps"]
    rows = golden_run(name)
    assert len(rows) == len(stored)
    for step, (got, want) in enumerate(zip(rows, stored), start=1):
        assert set(got) == set(want), (step, set(got) ^ set(want))
        off = {k: (want[k], v) for k, v in got.items() if v != pytest.approx(want[k], rel=REL, abs=ABS)}
        assert not off, f"{name}: step {step} left the golden curve: {off}"
