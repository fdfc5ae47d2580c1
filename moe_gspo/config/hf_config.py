"""A Hugging Face checkpoint's config.json read as the policy's ModelConfig (model.init_from): each family's field
names, and what this policy does not implement refused in one line naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

from moe_gspo.config.checks import ConfigError
from moe_gspo.config.model import FAMILIES, SIGMOID_FAMILIES, ModelConfig


def model_config_from_hf(path: str | Path, overrides: ModelConfig | None = None) -> ModelConfig:
    """Read config.json; refuse other architectures and MoE features this policy does not implement. The
    architecture comes from config.json; how to run it (params_dtype, spec, attention, experts, compile) and
    how to train it (the load-balancing loss) from `overrides`."""
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        c = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: invalid JSON ({e})") from None
    mt = c.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"{f}: model_type={mt!r}, architectures={c.get('architectures')}; moe-gspo loads "
                          f"{', '.join(FAMILIES)} checkpoints")
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{f}: dense layers (mlp_only_layers / decoder_sparse_step) are not supported")
    if c.get("sliding_window") is not None and (mt == "mixtral" or c.get("use_sliding_window")):
        raise ConfigError(f"{f}: sliding_window={c['sliding_window']}: sliding-window attention is not implemented "
                          "(every token attends to all before it)")
    if c.get("clip_qkv") is not None:
        raise ConfigError(f"{f}: clip_qkv={c['clip_qkv']}: clamping q/k/v is not implemented")
    if c.get("router_jitter_noise"):
        raise ConfigError(f"{f}: router_jitter_noise={c['router_jitter_noise']}: the router's training-time jitter "
                          "is not implemented (set it to 0 to train without it)")
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    base = overrides or ModelConfig()
    try:
        if mt == "mixtral":  # Mixtral's names for the same fields; its router always renormalizes
            family = dict(num_experts=c["num_local_experts"], moe_intermediate_size=c["intermediate_size"],
                          norm_topk_prob=True)
        elif mt == "olmoe":  # its experts' width is intermediate_size
            family = dict(num_experts=c["num_experts"], moe_intermediate_size=c["intermediate_size"],
                          norm_topk_prob=bool(c.get("norm_topk_prob", False)))
        elif mt in SIGMOID_FAMILIES:
            family = _sigmoid_family_fields(c, f, mt)
        elif mt == "gpt_oss":
            family = _gpt_oss_fields(c, f)
            rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 150_000.0)
        else:
            family = dict(num_experts=c.get("num_experts") or c["num_local_experts"],
                          moe_intermediate_size=c["moe_intermediate_size"],
                          norm_topk_prob=bool(c.get("norm_topk_prob", False)))
        if mt == "qwen2_moe":  # its q/k/v carry biases unless qkv_bias says otherwise
            family.update(shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
                          attention_bias=bool(c.get("qkv_bias", True)))
        return ModelConfig(
            family=mt, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c.get("qk_rope_head_dim") or c["hidden_size"] // c["num_attention_heads"],
            num_experts_per_tok=c["num_experts_per_tok"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope), max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            initializer_range=c.get("initializer_range", 0.02), params_dtype=base.params_dtype,
            spec=base.spec, attention=base.attention, compile=base.compile,
            experts=base.experts if getattr(base, "experts_chosen", True) else None,
            moe_router_load_balancing_type=base.moe_router_load_balancing_type,
            moe_aux_loss_coeff=base.moe_aux_loss_coeff, init_from=str(path), **family)
    except KeyError as e:
        raise ConfigError(f"{f}: missing field {e.args[0]!r}") from None


def _sigmoid_family_fields(c: dict, f: Path, mt: str) -> dict:
    """DeepSeek-V3's or GLM-4.5's config.json fields (their transformers configs' names) as ModelConfig fields;
    refuses what their layers here do not implement."""
    name = {"deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5"}[mt]
    refused = {"scoring_func": ("sigmoid", None), "topk_method": ("noaux_tc", None), "quantization_config": (None,)}
    yarn = _yarn_fields(c, f) if mt == "deepseek_v3" else None
    if mt != "deepseek_v3":
        refused["rope_scaling"] = (None,)
    if mt == "deepseek_v3":
        refused.update(rope_interleave=(True, None), attention_bias=(False, None))
    for key, allowed in refused.items():
        if c.get(key) not in allowed:
            raise ConfigError(f"{f}: {key}={c[key]!r}: moe-gspo's {name} implements "
                              f"{key}={allowed[0]!r} only" + (" (dequantize the weights to bfloat16 first)"
                                                               if key == "quantization_config" else ""))
    params = c.get("rope_parameters") or {}
    if params.get("rope_type", "default") not in ("default", "yarn" if yarn else "default"):
        raise ConfigError(f"{f}: rope_parameters.rope_type={params['rope_type']!r}: moe-gspo's {name} "
                          "implements plain rotary embeddings" + (" and YaRN" if mt == "deepseek_v3" else "") + " only")
    out = dict(num_experts=c["n_routed_experts"], moe_intermediate_size=c["moe_intermediate_size"],
               norm_topk_prob=bool(c.get("norm_topk_prob", True)),
               shared_expert_intermediate_size=int(c.get("n_shared_experts") or 0) * c["moe_intermediate_size"],
               first_k_dense_replace=int(c.get("first_k_dense_replace") or 0),
               intermediate_size=int(c["intermediate_size"]) if c.get("first_k_dense_replace") else 0,
               n_group=int(c.get("n_group") or 1), topk_group=int(c.get("topk_group") or 1),
               routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))
    if mt == "glm4_moe":
        return {**out, "attention_bias": bool(c.get("attention_bias", False)),
                "use_qk_norm": bool(c.get("use_qk_norm", False)),
                "partial_rotary_factor": float(c.get("partial_rotary_factor") or
                                               params.get("partial_rotary_factor", 1.0))}
    return {**out, "rope_scaling": yarn, "q_lora_rank": int(c.get("q_lora_rank") or 0),
            "kv_lora_rank": c["kv_lora_rank"],
            "qk_nope_head_dim": c["qk_nope_head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
            "v_head_dim": c["v_head_dim"]}


def _gpt_oss_fields(c: dict, f: Path) -> dict:
    """GPT-OSS's config.json fields as ModelConfig fields; refuses what its layers here do not implement. Without
    any rope settings transformers gives GPT-OSS its own YaRN (factor 32 over 4096 positions, not truncated), and so
    does this."""
    if c.get("quantization_config") is not None:
        raise ConfigError(f"{f}: quantization_config: moe-gspo's GPT-OSS loads unquantized weights only (dequantize "
                          "the MXFP4 experts to bfloat16 first)")
    if float(c.get("swiglu_alpha", 1.702)) != 1.702:
        raise ConfigError(f"{f}: swiglu_alpha={c['swiglu_alpha']}: moe-gspo's GPT-OSS implements 1.702 only "
                          "(megatron's quick_gelu)")
    given = c.get("rope_scaling") or c.get("rope_parameters")
    yarn = _yarn_fields(c, f, "gpt_oss") if given else {
        "factor": 32.0, "original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}
    return dict(num_experts=c["num_local_experts"], moe_intermediate_size=c["intermediate_size"],
                norm_topk_prob=True, attention_bias=bool(c.get("attention_bias", True)),
                sliding_window=int(c.get("sliding_window") or 0), layer_types=c.get("layer_types"),
                swiglu_limit=float(c.get("swiglu_limit", 7.0)), rope_scaling=yarn)


def _yarn_fields(c: dict, f: Path, mt: str = "deepseek_v3") -> dict | None:
    """YaRN settings from config.json (rope_scaling, or transformers 5's rope_parameters), or None for plain
    rotary embeddings. DeepSeek-V3's must round the correction range (megatron's YaRN does); GPT-OSS's may not."""
    given = c.get("rope_scaling") or {}
    params = c.get("rope_parameters") or {}
    name = {"deepseek_v3": "DeepSeek-V3", "gpt_oss": "GPT-OSS"}[mt]
    if not given and params.get("rope_type", "default") not in ("default", "yarn"):
        given = params  # refused below, naming its type
    if not given and params.get("rope_type") == "yarn":
        given = params
    if not given:
        return None
    kind = given.get("type", given.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(f"{f}: rope_scaling type {kind!r}: moe-gspo's {name} implements YaRN only")
    if given.get("attention_factor") is not None:
        raise ConfigError(f"{f}: rope_scaling.attention_factor: moe-gspo's YaRN derives the attention factor from "
                          "factor (and mscale)")
    if mt == "deepseek_v3" and given.get("truncate", True) is not True:
        raise ConfigError(f"{f}: rope_scaling.truncate=false: moe-gspo's DeepSeek-V3 rounds the correction range "
                          "(truncate=true)")
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    out = {k: float(given[k]) for k in keys if given.get(k) is not None}
    if mt == "gpt_oss":
        out["truncate"] = bool(given.get("truncate", True))
    return out
