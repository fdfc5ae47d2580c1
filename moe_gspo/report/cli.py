"""`moe-gspo report ...` subcommands (wired into moe_gspo/cli.py through add_subparser).

    moe-gspo report volatility RUN_DIR [RUN_DIR ...] [--out FILE.html]
    python -m moe_gspo.report.cli volatility RUN_DIR        # the same without the top-level CLI

add_subparser(subparsers) adds the `report` command with its own subcommands; each sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys


def _volatility(args: argparse.Namespace) -> int:
    from moe_gspo.report.volatility import write_volatility_report

    try:
        path = write_volatility_report(args.run_dirs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_report_commands(report_sub) -> None:
    """Add the report kinds (volatility; later: compare ...) to the `report` command's subparsers."""
    p = report_sub.add_parser("volatility", help="expert-flip / routing volatility report of one or more runs")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default=None, help="HTML path (default: FIRST_RUN_DIR/volatility.html)")
    p.set_defaults(func=_volatility)


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add `report` to a top-level CLI's subparsers; dispatch with `args.func(args)`."""
    p = subparsers.add_parser("report", help="HTML reports from run directories")
    add_report_commands(p.add_subparsers(dest="report_kind", required=True, metavar="KIND"))
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe-gspo report", description=__doc__.splitlines()[0])
    add_report_commands(parser.add_subparsers(dest="report_kind", required=True, metavar="KIND"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
