"""Step time of RL runs with different policy losses on the same model, data and seed (RSPO's cost vs GSPO).

    python scripts/bench_losses_rl.py --json runs/bench_losses_rl.json [--config configs/train_tiny_cpu.yaml]
        [--variants gspo,rspo] [--steps 6] [--rounds 3] [--cold-start 100]

One cold start (train.cold_start_steps, as `moe-gspo compare` does it), then every variant runs `--steps` RL steps
from those weights, `--rounds` times, variants alternating within each round so that machine drift hits all of
them alike. Per variant the table gives the median over all steps but the first of each run (warm-up) of the whole
step and of its phases (time/rollout, time/logprob: the old-log-prob pass, time/train: the minibatch updates), and
the ratio of each to the first variant. A variant is `name` (algorithm.loss=name) or `name:a.b=v:...`, e.g.
`grpo_rs:algorithm.loss=grpo:algorithm.router_shift=true`.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
PHASES = ("time/step", "time/rollout", "time/logprob", "time/train")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, *ovs = text.split(":")
    return name, ovs or [f"algorithm.loss={name}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/train_tiny_cpu.yaml")
    ap.add_argument("--variants", default="gspo,rspo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-start", type=int, default=100)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="a.b=value applied to every variant")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step of every run is warm-up)")

    from moe_gspo.config import apply_overrides, config_from_dict
    from moe_gspo.experiments.compare import cold_start_state
    from moe_gspo.train.loop import train

    import yaml

    base = yaml.safe_load(Path(args.config).read_text())
    base = apply_overrides(base, [f"train.steps={args.steps}", f"train.cold_start_steps={args.cold_start}",
                                  "train.checkpoint_every=0", "logging.progress=false", "logging.tensorboard=false",
                                  *args.overrides])
    variants = dict(parse_variant(v) for v in args.variants.split(","))
    cfgs = {n: config_from_dict(apply_overrides(copy.deepcopy(base), ovs)) for n, ovs in variants.items()}
    t0 = time.perf_counter()
    init = cold_start_state(config_from_dict(copy.deepcopy(base)))
    print(f"cold start: {args.cold_start} steps in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    samples: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, cfg in cfgs.items():
                run_dir = Path(tmp) / f"{name}_{r}"
                train(cfg, run_dir=run_dir, init_state=init, label=name)
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                for row in rows[1:]:  # the first step of a run warms up
                    for p in PHASES:
                        samples[name][p].append(row[p])
                print(f"round {r + 1}/{args.rounds} {name}: step {statistics.median(samples[name]['time/step']):.3f}"
                      f" s (median so far)", file=sys.stderr)

    med = {n: {p: statistics.median(v) for p, v in s.items()} for n, s in samples.items()}
    first = next(iter(variants))
    print(f"\n{len(samples[first]['time/step'])} steps per variant, medians in seconds, ratio to {first}")
    print(f"| variant | {' | '.join(PHASES)} | step ratio | logprob+train ratio |")
    print("|---" * (len(PHASES) + 3) + "|")
    result = {}
    for n, m in med.items():
        compute = m["time/logprob"] + m["time/train"]
        ratio = m["time/step"] / med[first]["time/step"]
        cratio = compute / (med[first]["time/logprob"] + med[first]["time/train"])
        print(f"| {n} | {' | '.join(f'{m[p]:.4f}' for p in PHASES)} | {ratio:.3f} | {cratio:.3f} |")
        result[n] = {"overrides": variants[n], "median_s": m, "step_ratio": ratio, "logprob_train_ratio": cratio,
                     "samples_s": samples[n]}
    if args.json:
        meta = {"config": args.config, "steps": args.steps, "rounds": args.rounds, "cold_start": args.cold_start,
                "overrides": args.overrides, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(), "baseline": first}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "variants": result}, indent=1))


if __name__ == "__main__":
    main()
