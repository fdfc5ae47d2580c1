"""The CPU workarounds for megatron-core: each patched name still exists, and the patched paths run."""

import pytest
import torch

from moe_gspo.parallel import cpu_compat

# the CPU patches apply only where CUDA is absent; with a GPU megatron runs its own CUDA paths
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied when CUDA is present")


def test_patched_names_exist_in_this_megatron():
    cpu_compat.check()  # raises naming what moved if megatron-core changed under us


@cpu_only
def test_patches_applied_without_cuda():
    cpu_compat.apply()
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # scoped: megatron's modules see a CPU torch.cuda, the process's torch is untouched
    assert mopt.torch.cuda.current_device() == torch.device("cpu")
    assert mopt.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.cuda.current_device is not cpu_compat._cpu_current_device
    assert torch.cuda.Stream is not cpu_compat._NullStream
    with pytest.raises((AssertionError, RuntimeError)):
        torch.tensor([1.0], device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"
    with cpu_compat.cuda_type_names():
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1).type() == "torch.FloatTensor"  # restored
    assert mrandom.model_parallel_cuda_manual_seed is cpu_compat._model_parallel_cpu_manual_seed
    assert moe_utils.te_general_gemm is None
    assert set(cpu_compat.PATCHED) >= {"tensor_parallel.random.model_parallel_cuda_manual_seed",
                                       "moe.moe_utils.te_general_gemm"}


@cpu_only
def test_rng_tracker_fork_is_reproducible():
    import moe_gspo
    from megatron.core.tensor_parallel import random as mrandom

    from moe_gspo.config import load_config

    moe_gspo.load_policy(load_config("configs/tiny_cpu.yaml"),
                         moe_gspo.init_parallel(load_config("configs/tiny_cpu.yaml")))
    tracker = mrandom.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork leaked into the default generator"
    mrandom.model_parallel_cuda_manual_seed(0)
    with tracker.fork():
        b = torch.rand(3)
    mrandom.model_parallel_cuda_manual_seed(0)
    with tracker.fork():
        c = torch.rand(3)
    assert torch.equal(b, c)


def test_transformers_imports_after_patches():
    """Import order does not matter: transformers imported after megatron's CPU patches sees the real torch.cuda."""
    import subprocess
    import sys

    code = ("import moe_gspo; from moe_gspo.config import load_config; cfg = load_config('configs/tiny_cpu.yaml'); "
            "moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg)); "
            "from transformers import Qwen3MoeForCausalLM; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_load_policy_prints_nothing():
    """The Python API builds a policy silently: megatron's notices that Apex and Transformer Engine are absent (the
    expected setup) are filtered from `import moe_gspo` on, and nothing else is printed."""
    import subprocess
    import sys

    code = ("import moe_gspo; groups = moe_gspo.init_parallel('configs/tiny_cpu.yaml'); "
            "moe_gspo.load_policy('configs/tiny_cpu.yaml', groups)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "" and r.stderr == "", r.stderr[-2000:]


@pytest.mark.parametrize("category,message,module,shown", [
    (UserWarning, "Apex is not installed. Falling back to Torch Norm", "megatron.core.fusions.fused_layer_norm",
     False),
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad ...",
     "megatron.core.optimizer.optimizer", False),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
     "torch.distributed.c10d_logger", False),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...",
     "torch.distributed.c10d_logger", False),
    # the same messages from anywhere else, and other warnings from those modules, are shown
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.", "moe_gspo.x", True),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated.", "mycode", True),
    (FutureWarning, "`torch.distributed.broadcast_object` is deprecated.", "torch.distributed.c10d_logger", True),
])
def test_only_the_warnings_a_user_cannot_act_on_are_silenced(category, message, module, shown):
    """A multi-rank run printed megatron's and torch's notices from every rank; the filters moe_gspo's import
    installs silence exactly those (by message, category and raising module) and nothing else. (pytest restores
    the filters after collecting, so the test installs them itself.)"""
    import warnings

    from moe_gspo.parallel.megatron_notices import quiet_missing_backends

    with warnings.catch_warnings(record=True) as seen:
        quiet_missing_backends()
        warnings.warn_explicit(message, category, "x.py", 1, module=module, registry={})
    assert len(seen) == int(shown)
