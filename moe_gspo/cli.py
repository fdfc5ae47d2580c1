"""`moe-gspo`: info | train-lm | train | rollout | compare | report.

    moe-gspo info
    moe-gspo train-lm --config configs/tiny_cpu.yaml train.steps=20
    moe-gspo compare --config configs/compare_tiny_cpu.yaml --out runs/compare
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _info(_args) -> int:
    import platform

    import torch

    def version(mod):
        try:
            m = importlib.import_module(mod)
            return getattr(m, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - report any import failure as unavailable
            return f"not available ({type(e).__name__})"

    import moe_gspo

    rows = [
        ("moe-gspo", moe_gspo.__version__), ("python", platform.python_version()), ("torch", torch.__version__),
        ("megatron-core", version("megatron.core")), ("transformers", version("transformers")),
        ("safetensors", version("safetensors")),
        ("CUDA", f"yes ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "no"),
        ("Transformer Engine", version("transformer_engine")), ("Triton", version("triton")),
        ("SGLang", version("sglang")), ("math-verify", version("math_verify")),
        ("CPU threads", str(torch.get_num_threads())),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="moe-gspo environment")
        t.add_column("component")
        t.add_column("version / availability")
        for k, v in rows:
            t.add_row(k, v)
        Console().print(t)
    except ImportError:
        for k, v in rows:
            print(f"{k:20s} {v}")
    return 0


def _train_lm(args) -> int:
    from moe_gspo.config import load_config
    from moe_gspo.lm_train import train_lm

    train_lm(load_config(args.config, args.overrides))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gspo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions and available backends").set_defaults(func=_info)
    t = sub.add_parser("train-lm", help="plain next-token training of the policy (smoke test of the stack)")
    t.add_argument("--config", required=True)
    t.add_argument("overrides", nargs="*", help="section.key=value")
    t.set_defaults(func=_train_lm)
    for mod, fn in (("moe_gspo.trainer_cli", "add_train_subparser"), ("moe_gspo.rollout.cli", "add_subparser"),
                    ("moe_gspo.trainer_cli", "add_compare_subparser"), ("moe_gspo.report.cli", "add_subparser")):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        getattr(m, fn)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    for cat in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=cat, module=r"megatron\..*")
    args = build_parser().parse_args(argv)
    from moe_gspo.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"moe-gspo: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
