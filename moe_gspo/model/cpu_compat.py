"""Every CPU workaround megatron-core 0.16.1 needs, in one place, applied only when CUDA is absent.

megatron-core assumes CUDA in a handful of spots. Each patch below names the megatron function it stands in
for; `apply()` is idempotent and `check()` raises loudly if a megatron upgrade moved or removed a patched name
(tests/test_cpu_compat.py runs it), so a version bump cannot silently un-patch anything.

Not patched on purpose: megatron's default causal mask is built on cuda inside GPTModel when no mask is given;
the policy always passes an explicit mask instead (moe_gspo/model/policy.py).
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False
PATCHED: dict[str, str] = {}  # "megatron or torch name" -> what replaced it


def _cpu_current_device():
    """Stands in for torch.cuda.current_device(), which megatron uses as a tensor device in ~60 places."""
    return torch.device("cpu")


class _NullStream:
    """Stands in for torch.cuda.Stream / current_stream() where megatron only orders work on a side stream.

    A class (not a lambda): libraries test `torch.cuda.Stream | None` in annotations at import time."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None

    def record_event(self, event=None):
        return None

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


def _model_parallel_cpu_manual_seed(seed: int, *args, **kwargs):
    """Stands in for megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed.

    Seeds the CPU generator and registers the tracker states megatron forks (dropout regions) with CPU states.
    Every rank gets the same data-parallel seed; tensor-parallel regions get seed + 2718 + tp_rank like megatron.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    # CudaRNGStatesTracker.add uses torch.cuda RNG calls; register CPU states directly.
    for name, s in ((mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank),
                    (mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed),
                    (mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * tp_rank)):
        g = torch.Generator().manual_seed(s)
        tracker.states_[name] = g.get_state()
        tracker.seeds_.add(s)


@contextlib.contextmanager
def _cpu_fork(self, name=None):
    """Stands in for CudaRNGStatesTracker.fork: swaps the CPU RNG state instead of the CUDA one."""
    from megatron.core.tensor_parallel import random as mrandom

    name = name or mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in self.states_:
        raise RuntimeError(f"rng state {name} is not added")
    orig = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)


def apply() -> None:
    """Install the CPU patches (no-op with CUDA or when already applied)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # 1. torch.cuda.current_device() used as a tensor device (router, experts, rotary, linear layers, DDP buffers).
    torch.cuda.current_device = _cpu_current_device
    PATCHED["torch.cuda.current_device (megatron call sites)"] = "returns cpu"
    # 2. megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed and CudaRNGStatesTracker.fork.
    mrandom.model_parallel_cuda_manual_seed = _model_parallel_cpu_manual_seed
    mrandom.CudaRNGStatesTracker.fork = _cpu_fork
    PATCHED["tensor_parallel.random.model_parallel_cuda_manual_seed"] = "CPU generator states"
    PATCHED["tensor_parallel.random.CudaRNGStatesTracker.fork"] = "CPU rng swap"
    # 3. moe_utils.router_gating_linear reads te_general_gemm, which is undefined when TE is missing.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    PATCHED["moe.moe_utils.te_general_gemm"] = "None (plain torch.mm path)"
    # 4. MoEAlltoAllTokenDispatcher's CUDA side stream for the device-to-host sync of token counts,
    #    and DDP's torch.cuda.current_stream()/Stream: CPU work is already ordered.
    torch.cuda.Stream = _NullStream  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    PATCHED["moe.token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream"] = "null stream"
    PATCHED["distributed.DistributedDataParallel current_stream/Stream"] = "null stream"
    _APPLIED = True


def check() -> None:
    """Fail loudly if a megatron-core upgrade moved something this module patches."""
    import megatron.core
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    missing = []
    for mod, name in ((mrandom, "model_parallel_cuda_manual_seed"), (mrandom, "CudaRNGStatesTracker"),
                      (mrandom, "_MODEL_PARALLEL_RNG_TRACKER_NAME"), (mrandom, "_DATA_PARALLEL_RNG_TRACKER_NAME"),
                      (mrandom, "_EXPERT_PARALLEL_RNG_TRACKER_NAME"), (moe_utils, "router_gating_linear"),
                      (token_dispatcher, "MoEAlltoAllTokenDispatcher")):
        if not hasattr(mod, name):
            missing.append(f"{mod.__name__}.{name}")
    tracker = mrandom.get_cuda_rng_tracker()
    for attr in ("states_", "seeds_", "reset", "fork"):
        if not hasattr(tracker, attr):
            missing.append(f"CudaRNGStatesTracker.{attr}")
    if missing:
        raise RuntimeError(f"moe_gspo.model.cpu_compat was written for megatron-core 0.16.1 but "
                           f"{megatron.core.__version__} lacks: {missing}; revisit every patch in this module")
