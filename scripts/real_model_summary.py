"""The figures docs/real-model.md registers for a run on the real model, recomputed from its metrics.jsonl.

    python scripts/real_model_summary.py docs/results/real_model/p1/metrics.jsonl [--json out.json]

- held-out greedy accuracy before training (train.eval_before's step-0 row) and at each evaluation, each with its
  Wilson interval, and the last evaluation's gain over the first with Newcombe's interval (conservative for the same
  items evaluated twice);
- the mean training reward over the first and the last `--window` steps (5);
- for multi-turn episodes, the same two means of each multiturn/ figure (turns, tool calls, their success, calls
  past the last turn);
- the median time of each phase of the step (time/...);
- the flip rate per update (routed slots whose expert changed): its mean, its largest value and the step where the
  first nonzero one was logged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_gspo.report.stats import newcombe, wilson  # noqa: E402


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def summary(rows: list[dict], window: int = 5) -> dict:
    evals = [(r["step"], r["eval/accuracy"], int(r["eval/prompts"])) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    if len(evals) < 2 or not steps:
        raise SystemExit("real_model_summary: error: needs an evaluation before training and one after")
    (s0, a0, n0), (s1, a1, n1) = evals[0], evals[-1]
    k0, k1 = round(a0 * n0), round(a1 * n1)
    gain = newcombe(k1, n1, k0, n0)
    flips = [r["moe/flip_rate"] for r in steps if "moe/flip_rate" in r]
    first = next((r["step"] for r in steps if r.get("moe/flip_rate", 0) > 0), None)
    return {
        "evaluations": [{"step": s, "accuracy": a, "prompts": n, "wilson95": wilson(round(a * n), n)}
                        for s, a, n in evals],
        "gain": {"from_step": s0, "to_step": s1, "difference": gain.mean, "newcombe95": [gain.lo, gain.hi],
                 "learned": gain.lo > 0},
        "window": window,
        "reward_first": _mean(steps[:window], "reward/mean"),
        "reward_last": _mean(steps[-window:], "reward/mean"),
        "multiturn": {k.split("/", 1)[1]: [_mean(steps[:window], k), _mean(steps[-window:], k)]
                      for k in ("multiturn/turns", "multiturn/tool_calls", "multiturn/tool_success",
                                "multiturn/tool_failures", "multiturn/calls_past_max_turns") if k in steps[0]},
        "phase_median_s": {k.split("/", 1)[1]: _median([r[k] for r in steps if k in r])
                           for k in sorted({k for r in steps for k in r if k.startswith("time/")})},
        "steps": len(steps),
        "flip_rate_mean": sum(flips) / len(flips) if flips else None,
        "flip_rate_max": max(flips) if flips else None,
        "first_step_with_flips": first,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--json", default=None)
    p.add_argument("--window", type=int, default=5, help="steps at each end whose means are compared (5)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    s = summary(rows, args.window)
    for e in s["evaluations"]:
        print(f"step {e['step']:>3}: held-out accuracy {e['accuracy']:.3f} of {e['prompts']} "
              f"(95% Wilson {e['wilson95'][0]:.3f} .. {e['wilson95'][1]:.3f})")
    g = s["gain"]
    print(f"gain step {g['from_step']} -> {g['to_step']}: {g['difference']:+.3f} (95% Newcombe {g['newcombe95'][0]:+.3f} "
          f".. {g['newcombe95'][1]:+.3f}): {'learned' if g['learned'] else 'not shown to learn'}")
    w = s["window"]
    print(f"training reward: first {w} steps {s['reward_first']:.3f}, last {w} {s['reward_last']:.3f} ({s['steps']} steps)")
    for k, (a, b) in s["multiturn"].items():
        print(f"multiturn/{k}: first {w} steps {a:.3f}, last {w} {b:.3f}")
    print("median phase times: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["phase_median_s"].items()))
    if s["flip_rate_mean"] is not None:
        print(f"flip rate per update: mean {s['flip_rate_mean']:.2e}, max {s['flip_rate_max']:.2e}, first nonzero at "
              f"step {s['first_step_with_flips']}")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
