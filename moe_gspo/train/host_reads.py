"""Where a step reads values back from the device, by call site.

    with host_syncs() as sites: ...     # on CUDA: every synchronizing operation, as torch's sync debug mode sees it
    with value_reads() as sites: ...    # anywhere, the CPU included: the reads that synchronize on a GPU

Each read of a device value to the host (.item(), int()/float()/bool() of a tensor, .tolist(), .cpu(), and the
operations whose output size depends on the values: nonzero, masked_select, a boolean-mask index, unique,
repeat_interleave without output_size, bincount) makes the host wait until the device has run everything queued
before it; meanwhile no kernel is queued ahead, and a step of small kernels runs at the speed of its launches.
`host_syncs` counts them on a GPU. `value_reads` counts the same operations on any device, so that a CPU run finds
the reads a GPU step would take. It counts every such read, including reads of tensors that stay on the host in a
GPU run as well (sample ids, host-built bounds): its call sites say which is which. Copies from the host to the
device are not counted by `value_reads`.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = str(Path(torch.__file__).parent)
_MACHINERY = {__file__, warnings.__file__, contextlib.__file__}  # frames between the read and who asked for it

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text under torch.cuda.set_sync_debug_mode


def _site(default: str = "?") -> str:
    """"file:line (function)" of the innermost frame outside torch, this module and the warnings and contextlib
    machinery: where our code or megatron's asked for the value (`default` when no such frame is on the stack)."""
    frames = [f for f in traceback.extract_stack()
              if not f.filename.startswith(_TORCH_DIR) and f.filename not in _MACHINERY]
    f = frames[-1] if frames else None
    return f"{_short_path(f.filename)}:{f.lineno} ({f.name})" if f else default


@contextmanager
def host_syncs():
    """Count the block's device-to-host synchronizations by call site: yields a Counter of "file:line (function)"
    -> syncs, filled as the block runs. On CUDA, torch.cuda.set_sync_debug_mode('warn') makes every synchronizing
    operation (.item(), .tolist(), .cpu(), a boolean mask, nonzero) warn, and each warning is attributed to the
    innermost frame of the Python stack outside torch itself, where our code or megatron's asked for the value.
    Elsewhere nothing synchronizes and the Counter stays empty."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return shown(message, category, filename, lineno, file, line)
        sites[_site(default=f"{filename}:{lineno}")] += 1

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every one, not once per site
        shown = warnings.showwarning
        warnings.showwarning = record
        mode = torch.cuda.get_sync_debug_mode() if cuda else None
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)


def _short_path(filename: str) -> str:
    """A source path from its package root on (moe_gspo/..., megatron/..., transformers/...)."""
    parts = Path(filename).parts
    for root in ("moe_gspo", "megatron", "transformers", "kernels", "scripts", "tests"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return filename


# operators whose result the host must see (scalars) or whose output size depends on the values
_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero", "aten::equal",
          "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::bincount", "aten::allclose"}


def _is_read(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in _READS:
        return True
    if name in ("aten::index", "aten::index_put", "aten::index_put_"):  # a boolean mask is a nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    if name == "aten::repeat_interleave":  # tensor repeats: the output size, unless given
        repeats = args[1] if len(args) > 1 else args[0]
        return isinstance(repeats, torch.Tensor) and (kwargs or {}).get("output_size") is None
    return False


class _Reads(TorchDispatchMode):
    def __init__(self, sites: Counter):
        super().__init__()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_read(func, args, kwargs):
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def value_reads():
    """Count the block's reads of tensor values to the host by call site, on any device: yields a Counter of
    "file:line (function)" -> reads, filled as the block runs (forward and backward). The operators are caught
    below autograd; .tolist(), .numpy() and .cpu(), which read a CPU tensor without an operator, are caught at
    their Python methods."""
    sites: Counter = Counter()
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
    own = {name: name in vars(torch.Tensor) for name in methods}  # else inherited from the C base: delete after

    def counted(name, method):
        def read(self, *args, **kwargs):
            sites[_site()] += 1
            return method(self, *args, **kwargs)
        read.__name__ = name
        return read

    for name, method in methods.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        with _Reads(sites):
            yield sites
    finally:
        for name, method in methods.items():
            if own[name]:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)
