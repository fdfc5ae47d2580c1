"""Bucketed weight sync: the policy's exported tensors copied into an engine's parameters a bucket at a time.

    n = copy_in_buckets(dests, state, bucket_bytes=256 * 2**20)   # dests: [(engine parameter view, state key)]

A bucket is one flat buffer in the engine's dtype, on the device the exported tensors live on. The tensors of a
bucket are packed into it with one multi-tensor copy (`torch._foreach_copy_`, casting to the engine's dtype), the
buffer moves to the engine's device in one transfer (nothing moves when both sides share a device), and one more
multi-tensor copy unpacks it into the engine's parameters. On a GPU this replaces one copy launch per tensor
(thousands for a model with many experts) by two per bucket. The state is read in the order given, once per key, so
a streamed state (moe_gspo.model.hf_shards.StreamedHFState, gathering under TP/EP on reading) works; what is held at
once beyond the engine's own weights is one bucket and the tensors read for it, never a copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def buckets(items: Iterable[T], load: Callable[[T], dict[Hashable, int]], bound: int,
            joins: Callable[[T, T], bool] | None = None) -> Iterator[list[T]]:
    """Consecutive items in buckets, lazily (an item is read when its bucket is being filled): every weight sync
    here (the hf engines' in-place copy, the pushes to engine ranks, the shard-to-shard rounds, SGLang's updates)
    cuts its stream with this. `load(item)` is the bytes the item adds to each resource it uses ({None: n} for one
    buffer; a rank's sends and receives for a round of point-to-point transfers); a bucket closes before an item
    would take any resource past `bound`, or that `joins(first item of the bucket, item)` refuses. An item of more
    than `bound` on any resource is a bucket by itself."""
    if bound <= 0:
        raise ValueError(f"bucket bound {bound} must be > 0")
    cur: list[T] = []
    used: dict[Hashable, int] = {}
    for item in items:
        add = load(item)
        if cur and (any(used.get(r, 0) + b > bound for r, b in add.items() if b)
                    or (joins is not None and not joins(cur[0], item))):
            yield cur
            cur, used = [], {}
        cur.append(item)
        for r, b in add.items():
            used[r] = used.get(r, 0) + b
        if any(b > bound for b in add.values()):
            yield cur
            cur, used = [], {}
    if cur:
        yield cur


@torch.no_grad()
def copy_in_buckets(dests: Sequence[tuple[torch.Tensor, str]], state: Mapping[str, torch.Tensor],
                    bucket_bytes: int) -> int:
    """Copy state[key] into dest for every (dest, key), in buckets of at most `bucket_bytes` bytes of destination
    data (a tensor larger than that is a bucket by itself). Returns the number of buckets. The result is what
    `dest.copy_(state[key])` gives, tensor by tensor: the same rounding to the engine's dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")

    def read(dest_key):
        dest, key = dest_key
        src = state[key]
        if tuple(src.shape) != tuple(dest.shape):
            raise ValueError(f"{key}: exported shape {tuple(src.shape)} != the engine's {tuple(dest.shape)}")
        return dest, src

    n = 0
    for bucket in buckets(map(read, dests), lambda ds: {None: ds[0].numel() * ds[0].element_size()}, bucket_bytes,
                          _same_bucket):
        _flush(bucket)
        n += 1
    return n


def _same_bucket(first: tuple[torch.Tensor, torch.Tensor], item: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """One bucket holds one destination dtype and device, read from one source device."""
    (d0, s0), (dest, src) = first, item
    return d0.dtype == dest.dtype and d0.device == dest.device and s0.device == src.device


def _flush(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    dests = [d for d, _ in pending]
    srcs = [s for _, s in pending]
    sizes = [d.numel() for d in dests]
    flat_N = torch.empty(sum(sizes), dtype=dests[0].dtype, device=srcs[0].device)  # packed where the policy is
    torch._foreach_copy_([p.view(d.shape) for p, d in zip(flat_N.split(sizes), dests)], srcs)
    flat_N = flat_N.to(dests[0].device, non_blocking=dests[0].device.type == "cuda")
    torch._foreach_copy_(dests, [p.view(d.shape) for p, d in zip(flat_N.split(sizes), dests)])


def cast_into(dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dest.copy_(src), bitwise the same, faster for a source in another dtype laid out transposed to dest (a 2-D
    view whose columns are contiguous: how megatron's grouped expert weights look as HF tensors). On the CPU,
    torch's copy that casts and transposes in one pass ran 4.3x slower than a cast in the source's own order
    followed by a transposing copy in the destination's dtype ([256, 1024] fp32 to bf16, one thread: 0.59 ms
    against 0.14 ms). The second way holds one piece's cast copy at a time."""
    if src.dtype != dest.dtype and src.dim() == 2 and src.stride(0) < src.stride(1):
        return dest.copy_(src.t().to(dest.dtype).t())
    return dest.copy_(src)

