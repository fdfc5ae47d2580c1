"""Command lines of the torchrun test workers, one thread per rank.

    args = checkpoint_args()                      # --ckpt CKPT [--tp N] [--ep N] --out FILE
    args = checkpoint_args(lambda ap: ap.add_argument("--batch", type=int, default=4))
    args = override_args()                        # --out FILE [a.b=v ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def checkpoint_args(extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """A worker that loads a saved policy at a TP x EP layout and writes its results to --out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    if extra is not None:
        extra(ap)
    return _parsed(ap)


def override_args() -> argparse.Namespace:
    """A worker configured by config overrides (a.b=v ...) that writes its results to --out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    return _parsed(ap)


def _parsed(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    torch.set_num_threads(1)  # ranks share the machine's cores
    return args
