"""Every CPU workaround megatron-core 0.16.1 needs, in one place, applied only when CUDA is absent (except 3) and only to
megatron's own modules: importing moe_gspo changes nothing in torch or in any other library.

megatron-core assumes CUDA in a handful of ways, each handled below:
1. `torch.cuda.current_device()` used as a tensor device (~60 sites: router, experts, rotary, linear layers, DDP
   buffers), `torch.cuda.Stream` / `current_stream()` / `synchronize()` where megatron only orders work on a side
   stream (alltoall dispatcher, DDP), and literal `device='cuda'` in tensor factories (optimizer scale and
   found-inf buffers, grad scaler, clip_grads' norm buffers). Each `megatron.core.*` module's global name `torch`
   is rebound to `CPU_TORCH`, a view of torch whose `cuda` namespace answers with CPU equivalents and whose
   factories read 'cuda' as 'cpu'. The real `torch` module is untouched, so transformers, triton and the rest of
   the process see the CUDA-less torch they expect, and import order does not matter.
2. `tensor_parallel.random.model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker.fork` use CUDA generators:
   replaced by CPU-generator twins.
3. `moe_utils.te_general_gemm` is undefined without Transformer Engine: set to None (the plain torch.mm path).
   This one is applied with CUDA too, since a GPU machine without Transformer Engine hits it alike.
4. `Float16OptimizerWithFloat16Params` and `DistributedOptimizer` sort parameters by `param.type()` strings that
   exist only on CUDA ('torch.cuda.BFloat16Tensor'), and `clip_grad_by_total_norm_fp32` asserts one:
   inside `cuda_type_names()`, which moe_gspo.train.optim enters around megatron's optimizer construction and
   step only, CPU float tensors answer with those names; `Tensor.type` is restored on exit.

5. Without Apex or Transformer Engine (torch's Adam, on a GPU too), `DistributedOptimizer` loading its
   'fully_reshardable' checkpoint state copies every per-parameter state into place, "step" included, but the
   checkpoint provides no per-parameter "step" (megatron restores it from the param groups): KeyError. Inside
   `torch_adam_state_load()`, which moe_gspo.checkpoint.store enters around the optimizer's load_state_dict only,
   `_set_main_param_and_optimizer_states` copies the states the checkpoint provides and leaves "step" as the param
   groups set it; the method is restored on exit.
6. Without Transformer Engine, `multi_latent_attention.HAVE_TE` still reads True: its import of megatron's TE
   extension succeeds on placeholder classes, and building MLA then fails at `isinstance(linear_proj, TELinear)`
   ("isinstance() arg 2 must be a type"). Set to False when transformer_engine does not import (on a GPU too),
   and `multi_latent_attention.Linear` (None then) to megatron's own replicated `post_training.modelopt.layers.Linear`,
   which MLA accepts for its down projections: the local spec's ColumnParallelLinear there gives wrong gradients
   under tensor parallelism (the rotary key's gradient, partial per TP rank, is never summed; the TE spec's
   duplicated TELinear takes the path that sums it), so moe_gspo's MLA spec uses that Linear (model.spec).

7. Activation recompute (`tensor_parallel.checkpoint`, megatron's full and selective recompute) saves and restores
   the CUDA generator's state beside the CPU's with `_get_cuda_rng_state` / `_set_cuda_rng_state`, which call into
   CUDA: without CUDA the first returns None and the second does nothing (the CPU generator, which CPU dropout
   draws from, is saved and restored by megatron's own code).

`apply()` is idempotent and cheap; it is called before a model, optimizer or checkpoint is built, so megatron modules
imported lazily are scoped too. `check()` raises if a megatron upgrade moved a patched name
(tests/test_cpu_compat.py runs it), so a version bump cannot silently un-patch anything.

Not patched on purpose: megatron's default causal mask is built on cuda inside GPTModel when no mask is given;
the policy always passes an explicit mask instead (moe_gspo/model/policy.py).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

PATCHED: dict[str, str] = {}  # "megatron name" -> what replaced it
_GLOBALS_DONE = False
_SCOPED_AT = -1  # len(sys.modules) when megatron's modules were last scoped


def _cpu_current_device():
    """Stands in for torch.cuda.current_device(), which megatron uses as a tensor device."""
    return torch.device("cpu")


class _NullStream:
    """Stands in for torch.cuda.Stream / current_stream() where megatron only orders work on a side stream."""

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


class _CpuCuda(types.ModuleType):
    """What megatron's modules see as `torch.cuda` on a CUDA-less machine; other names come from torch.cuda."""

    def __init__(self):
        super().__init__("moe_gspo_cpu_cuda")
        self.current_device = _cpu_current_device
        self.Stream = _NullStream
        self.current_stream = lambda *a, **k: _NullStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda *a, **k: None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(fn):
    """A torch tensor factory that reads device='cuda' (or cuda:N) as the CPU."""

    def wrapped(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapped.__name__ = getattr(fn, "__name__", "factory")
    return wrapped


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "as_tensor")


class _CpuTorch(types.ModuleType):
    """`torch` as megatron's modules see it on a CUDA-less machine: torch with a CPU `cuda` namespace and
    factories that place 'cuda' tensors on the CPU. Attributes are looked up once and cached."""

    def __init__(self):
        super().__init__("moe_gspo_cpu_torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


CPU_TORCH = _CpuTorch()


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


def _scope_megatron_modules() -> int:
    """Rebind `torch` to CPU_TORCH in every loaded megatron.core module; returns how many were rebound. Skips the
    scan (thousands of modules, about a millisecond; apply() runs around every optimizer step) while no module was
    imported since the last one."""
    global _SCOPED_AT
    if len(sys.modules) == _SCOPED_AT:
        return 0
    _SCOPED_AT = len(sys.modules)
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(mod, "torch", None) is torch:
            mod.torch = CPU_TORCH
            n += 1
    return n


def apply() -> None:
    """Install the CPU patches into megatron's modules (no-op with CUDA). Idempotent; cheap to call again after
    more megatron modules were imported."""
    global _GLOBALS_DONE
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # without Transformer Engine, on a GPU too
        moe_utils.te_general_gemm = None
        PATCHED["moe.moe_utils.te_general_gemm"] = "None (plain torch.mm path)"
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not _te_imports():
        from megatron.core.post_training.modelopt.layers import Linear

        multi_latent_attention.HAVE_TE, multi_latent_attention.Linear = False, Linear
        PATCHED["transformer.multi_latent_attention.HAVE_TE"] = "False (Transformer Engine does not import)"
        PATCHED["transformer.multi_latent_attention.Linear"] = "megatron's post_training.modelopt.layers.Linear"
    if torch.cuda.is_available():
        return
    if not _GLOBALS_DONE:
        # import the megatron modules moe_gspo drives, so that they are scoped now
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
        import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.optimizer_param_scheduler  # noqa: F401
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe import token_dispatcher

        mrandom.model_parallel_cuda_manual_seed = _model_parallel_cpu_manual_seed
        mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
        mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
        PATCHED["tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state"] = "None / no-op (no CUDA generator)"
        mrandom.CudaRNGStatesTracker.fork = _cpu_fork
        PATCHED["tensor_parallel.random.model_parallel_cuda_manual_seed"] = "CPU generator states"
        PATCHED["tensor_parallel.random.CudaRNGStatesTracker.fork"] = "CPU rng swap"
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
        PATCHED["moe.token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream"] = "None (CPU work is ordered)"
        PATCHED["megatron.core.* module global `torch`"] = "CPU_TORCH (cuda namespace and factories on the CPU)"
        _GLOBALS_DONE = True
    _scope_megatron_modules()


def _te_imports() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means megatron's TE layers cannot be used
        return False
    return True


_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
              "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def cuda_type_names():
    """Around megatron optimizer calls: CPU float tensors report CUDA type names from `Tensor.type()`, which is how
    megatron's Float16/Distributed optimizers sort parameters into fp32 and bf16 groups and how its grad clipping
    checks main grads. No-op with CUDA."""
    apply()
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu":
            return _CUDA_TYPE.get(out, out)
        return out

    torch.Tensor.type = cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def torch_adam_state_load():
    """Around megatron optimizer load_state_dict calls: DistributedOptimizer copies a parameter's main param and
    Adam moments from the checkpoint and skips the states the checkpoint does not carry ("step", restored from the
    param groups). No-op with Apex or Transformer Engine, whose Adam keeps no per-parameter step."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states
    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return

    def set_provided_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            dst[key].copy_(value)

    cls._set_main_param_and_optimizer_states = set_provided_states
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original


def check() -> None:
    """Fail loudly if a megatron-core upgrade moved something this module patches."""
    import megatron.core
    from megatron.core.optimizer import distrib_optimizer as dopt
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    missing = []
    for mod, name in ((mrandom, "model_parallel_cuda_manual_seed"), (mrandom, "CudaRNGStatesTracker"),
                      (mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state"),
                      (mrandom, "_MODEL_PARALLEL_RNG_TRACKER_NAME"), (mrandom, "_DATA_PARALLEL_RNG_TRACKER_NAME"),
                      (mrandom, "_EXPERT_PARALLEL_RNG_TRACKER_NAME"), (moe_utils, "router_gating_linear"),
                      (token_dispatcher, "MoEAlltoAllTokenDispatcher"),
                      (mopt, "Float16OptimizerWithFloat16Params"), (mopt, "FP32Optimizer"),
                      (dopt.DistributedOptimizer, "_set_main_param_and_optimizer_states"),
                      (dopt.DistributedOptimizer, "load_parameter_state_from_fully_reshardable"),
                      (dopt, "HAVE_APEX_OR_TE"), (multi_latent_attention, "HAVE_TE")):
        if not hasattr(mod, name):
            missing.append(f"{mod.__name__}.{name}")
    tracker = mrandom.get_cuda_rng_tracker()
    for attr in ("states_", "seeds_", "reset", "fork"):
        if not hasattr(tracker, attr):
            missing.append(f"CudaRNGStatesTracker.{attr}")
    if missing:
        raise RuntimeError(f"moe_gspo.parallel.cpu_compat was written for megatron-core 0.16.1 but "
                           f"{megatron.core.__version__} lacks: {missing}; revisit every patch in this module")
