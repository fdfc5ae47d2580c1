"""`moe-gspo train` and `moe-gspo compare`: moe_gspo/cli.py adds them through the add_*_subparser functions.

    moe-gspo train --config configs/train_tiny_cpu.yaml [--resume] [--out DIR] [a.b=v ...]
    moe-gspo compare --config configs/compare_tiny_cpu.yaml --out DIR [--only grpo,gspo] [a.b=v ...]
    torchrun --nproc-per-node 2 -m moe_gspo.trainer --config C parallel.ep=2     # same flags as `train`
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_gspo.config import ConfigError


def add_train_subparser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="RL-train the policy (GRPO / GSPO / GSPO-token)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_args(p)
    p.set_defaults(func=run_train)
    return p


def _train_args(p):
    p.add_argument("--config", required=True, help="YAML config (configs/train_tiny_cpu.yaml)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--out", default=None, help="run directory (default: train.out_dir)")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=value")


def add_compare_subparser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="GRPO, GRPO+R2, GRPO+R3, GSPO, GSPO-token side by side + report",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config with a `compare:` section "
                                                   "(configs/compare_tiny_cpu.yaml)")
    p.add_argument("--out", required=True, help="output directory: DIR/<variant>/ and DIR/report.html")
    p.add_argument("--only", default=None, help="comma-separated subset of the variants to run")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=value, applied to every variant")
    p.set_defaults(func=run_compare)
    return p


def run_train(args) -> int:
    from moe_gspo.config import load_config
    from moe_gspo.train.checkpoint import CheckpointError
    from moe_gspo.trainer import train

    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg, resume=args.resume, run_dir=args.out)
    except (ConfigError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_compare(args) -> int:
    from moe_gspo.compare import run_comparison

    try:
        report = run_comparison(args.config, args.out, args.overrides,
                                only=args.only.split(",") if args.only else None)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(report)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_gspo.trainer", description="RL training (see moe-gspo train)")
    _train_args(p)
    return run_train(p.parse_args(argv))
