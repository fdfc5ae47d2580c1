"""Which model families each rollout engine serves, and what vLLM's model of a family computes whatever config.json
says: refused in one line at config load (Config) and again when an engine is built (moe_gspo.rollout.vllm_engine)."""

from __future__ import annotations

from moe_gspo.config.checks import ConfigError
from moe_gspo.config.gpt_oss_vllm import vllm_gpt_oss_mismatch
from moe_gspo.config.model import ModelConfig


ENGINE_FAMILIES = {"vllm": ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"),
                   "sglang": ("qwen3_moe",)}
"""The model families each engine with a weight sync of its own serves (the hf engines serve every family): vLLM's
loads the families' names and layouts (moe_gspo.rollout.vllm_cpu, vllm_shards, vllm_mla); SGLang's maps Qwen3-MoE's
only."""

VLLM_FIXED_RMS_NORM_EPS = {"olmoe": 1e-5, "gpt_oss": 1e-5}
"""model.family -> the RMSNorm epsilon vLLM's model of that family uses whatever config.json says (vLLM 0.32's
OLMoE and GPT-OSS hard-code 1e-5, the released checkpoints' value)."""

VLLM_HEAD_DIM_FROM_HIDDEN = ("qwen2_moe", "olmoe")
"""Families whose vLLM attention takes head_dim = hidden_size / num_attention_heads, ignoring config.json's
head_dim (vLLM 0.32)."""


def engine_family_refusal(engine: str, family: str) -> str:
    """The one line refusing `engine` for a family it does not serve."""
    return (f"rollout.engine={engine} serves model.family in {list(ENGINE_FAMILIES[engine])} only; for "
            f"model.family='{family}' use rollout.engine=hf or hf_static")


def vllm_family_mismatch(family: str, rms_norm_eps: float, head_dim: int, hidden_size: int, num_attention_heads: int,
                         gpt_oss: tuple | None = None) -> str | None:
    """Why the vLLM engine cannot serve this family, or its model would compute another function than these fields
    say (one line), or None. gpt_oss: GPT-OSS's (swiglu_limit, sliding_window, layer_types, YaRN dict or None)."""
    if family not in ENGINE_FAMILIES["vllm"]:
        return engine_family_refusal("vllm", family)
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


def check_engine_family(mc: ModelConfig, rc) -> None:
    """ConfigError (one line) for a rollout engine that cannot serve this model exactly."""
    if mc.family not in ENGINE_FAMILIES.get(rc.engine, (mc.family,)):
        raise ConfigError(engine_family_refusal(rc.engine, mc.family))
    if rc.engine == "vllm":
        why = vllm_family_mismatch(mc.family, mc.rms_norm_eps, mc.head_dim, mc.hidden_size, mc.num_attention_heads,
                                   (mc.swiglu_limit, mc.sliding_window, mc.layer_types or [], mc.rope_scaling))
        if why:
            raise ConfigError(why)
