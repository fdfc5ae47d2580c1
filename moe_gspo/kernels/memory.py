"""Peak memory of one call, for the kernels' workspace tests and scripts/bench_logprob.py.

    peak_bytes(fn) -> int   # peak bytes allocated while fn() runs, above what was allocated before it

CUDA: torch.cuda.max_memory_allocated after a reset. CPU: the torch profiler's allocation events
(profile_memory=True: every allocation and free of the CPU allocator with its timestamp), summed in time order.
BLAS-internal scratch is not counted on either.
"""
from __future__ import annotations

import torch


def peak_bytes(fn, device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated on `device` while fn() runs, beyond what was allocated when it started."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    events, stack = [], list(p.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.tag == _EventType.Allocation:
            events.append((n.start_time_ns, n.extra_fields.alloc_size))
        stack.extend(n.children)
    cur = top = 0
    for _, size in sorted(events):
        cur += size
        top = max(top, cur)
    return top
