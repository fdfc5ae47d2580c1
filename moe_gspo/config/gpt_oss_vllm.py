"""What vLLM's GPT-OSS computes whatever config.json says (vLLM 0.32), checked at config load and at engine build
(moe_gspo.config.engine_families.vllm_family_mismatch): its experts' SwiGLU is clamped at 7 (the model passes no limit to its
fused-MoE layer, whose CPU kernel clamps at 7: measured, the kernel's output equals the clamp at 7 and differs by
O(10) from the clamp at 5, at 10 and from none); its sliding window is on the even layers (0, 2, ...) whatever
layer_types says; its rotary embedding is always YaRN, built from factor, original_max_position_embeddings,
beta_fast, beta_slow and truncate (no mscale). RMSNorm's eps 1e-5 is engine_families.VLLM_FIXED_RMS_NORM_EPS's rule."""

from __future__ import annotations

VLLM_GPT_OSS_SWIGLU_LIMIT = 7.0


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
