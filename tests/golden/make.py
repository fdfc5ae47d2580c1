"""The golden curve: per-step metrics of a short tiny RL run, stored so that a later commit that changes what
training computes fails tests/test_golden.py instead of drifting unnoticed.

    python tests/golden/make.py            # rewrite tests/golden/train_tiny_gspo.json from today's code

Refresh only on purpose (a change meant to alter training), and say why in the commit message.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CONFIG = ROOT / "configs" / "train_tiny_cpu.yaml"
OUT = HERE / "train_tiny_gspo.json"
OVERRIDES = ["train.steps=10", "train.cold_start_steps=60", "train.checkpoint_every=0", "logging.progress=false",
             "logging.tensorboard=false"]
SKIP_PREFIXES = ("time/", "perf/")


def golden_run(overrides: list[str] = ()) -> list[dict[str, float]]:
    """Per-step metrics (timings left out) of the golden run, with extra overrides after the fixed ones."""
    from moe_gspo.config import load_config
    from moe_gspo.train.loop import train

    cfg = load_config(CONFIG, [*OVERRIDES, *overrides])
    with tempfile.TemporaryDirectory() as d:
        train(cfg, run_dir=d)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES)} for r in rows]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    rows = golden_run()
    out.write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "overrides": OVERRIDES, "steps": rows},
                              indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(rows)} steps")
