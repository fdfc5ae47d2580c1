"""The statistics tables of the committed studies: every table that `scripts/study_summary.py` and the comparison
summary print from docs/results/, recomputed from the raw metrics there, so that a change to moe_gspo/report/stats.py
that moves a printed digit fails tests/test_stats_tables.py.

    python tests/golden/stats_tables.py          # rewrite tests/golden/stats_tables.txt from today's code

Refresh only on purpose (a change meant to alter a printed number), and say why in the commit message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = ROOT / "docs" / "results"
GOLDEN = HERE / "stats_tables.txt"

# (study_summary.py subcommand, its arguments relative to docs/results/), as docs/findings.md runs them
COMMANDS = [
    ("paired", ["regime/runs"]),
    ("paired", ["stabilizers/runs"]),
    ("paired", ["vllm/runs"]),
    ("paired", ["compare_seeds/runs"]),
    ("paired", ["compare_tiny/runs"]),
    ("contrasts", ["regime/runs", "grpo_r2-grpo", "grpo_r3-grpo", "gspo-grpo", "gspo_token-grpo"]),
    ("contrasts", ["regime/runs", "grpo_lr3e5-grpo", "gspo_lr3e5-grpo_lr3e5", "gspo_lr2e4-grpo_lr2e4",
                   "gspo_engine-gspo", "gspo_weak-grpo_weak"]),
    ("contrasts", ["routing_choice/runs", "grpo_top8-grpo_top2", "gspo_top2-grpo_top2",
                   "gspo_top2-grpo_top2/gspo_top8-grpo_top8"]),
    ("contrasts", ["response_length/runs", "gspo_L160-grpo_L160/gspo_L16-grpo_L16", "gspo_nonorm_L160-gspo_L160",
                   "gspo_nonorm_L16-gspo_L16"]),
    ("contrasts", ["offpolicy_depth/runs", "grpo_mb32-grpo_mb8", "grpo_r3_mb32-grpo_mb32", "gspo_mb32-grpo_mb32"]),
    ("regime", ["regime/runs"]),
    ("regime", ["stabilizers/runs"]),
    ("regime", ["vllm/runs"]),
    ("granularity", ["granularity/runs"]),
    ("volatility", ["volatility/runs"]),
    ("precision", ["--bf16", "precision/bf16", "--fp16", "precision/fp16", "--fp32", "precision/fp32"]),
    ("precision", ["--bf16", "precision/bf16", "--bf16-r3", "precision/bf16_r3"]),
    ("precision", ["--fp16", "precision/fp16", "--fp16-r3", "precision/fp16_r3"]),
]
SUMMARIES = ["regime/runs", "stabilizers/runs", "vllm/runs", "compare_seeds/runs", "compare_tiny/runs",
             "routing_choice/runs", "response_length/runs", "offpolicy_depth/runs"]


def _study_summary():
    spec = importlib.util.spec_from_file_location("study_summary", ROOT / "scripts" / "study_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tables() -> dict[str, str]:
    """{command line: what it prints}, every path relative to docs/results/."""
    from moe_gspo.report.compare_data import summary_lines

    ss = _study_summary()
    out = {}
    for cmd, args in COMMANDS:
        argv = [cmd] + [str(RESULTS / a) if (RESULTS / a).exists() else a for a in args]
        buf = io.StringIO()
        saved = sys.argv
        sys.argv = ["study_summary.py", *argv]
        try:
            with contextlib.redirect_stdout(buf):
                ss.main()
        finally:
            sys.argv = saved
        out[" ".join([cmd, *args])] = buf.getvalue().replace(str(RESULTS) + "/", "")
    for d in SUMMARIES:
        out[f"summary {d}"] = "\n".join(summary_lines(RESULTS / d)) + "\n"
    return out


def render(t: dict[str, str]) -> str:
    return "".join(f"=== {k}\n{v}" for k, v in t.items())


def parse(text: str) -> dict[str, str]:
    out, key = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("=== "):
            key = line[4:].rstrip("\n")
            out[key] = ""
        else:
            out[key] += line
    return out


if __name__ == "__main__":
    GOLDEN.write_text(render(tables()))
    print(f"wrote {GOLDEN}")
