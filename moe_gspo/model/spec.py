"""The policy's architecture as a megatron-core TransformerConfig and one layer spec per decoder layer: megatron's
local spec with this package's router, norms, attention and experts (model.spec='local', anywhere), or megatron's
Transformer Engine spec (model.spec='te', CUDA with transformer_engine). Multi-head latent attention (DeepSeek-V3) is
megatron's MLASelfAttention with this package's SDPA core attention and norms; dense first layers are megatron's
MLP."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from moe_gspo.config import ConfigError, ModelConfig, ParallelConfig
from moe_gspo.model import families, te_names
from moe_gspo.model.experts import GroupedGemmExperts
from moe_gspo.model.layers import KeyNormAllHeads, QueryNormAllHeads, RMSNorm, SDPAttention, TorchLoopExperts
from moe_gspo.model.rope import yarn_attention_factor
from moe_gspo.model.router import MoERouter


def te_missing() -> str | None:
    """Why the Transformer Engine spec cannot run here (None when it can): TE is CUDA-only."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means TE cannot run; say which
        return f"transformer_engine does not import ({type(e).__name__}: {e})"
    return None


def transformer_config(mc: ModelConfig, pc: ParallelConfig, recompute: str = "none",
                       recompute_layers: int = 1) -> TransformerConfig:
    """Megatron's config for the model's architecture (see docs/guide/architecture.md for each choice), with activation
    recompute as train.recompute names it."""
    dtype = torch.bfloat16 if mc.params_dtype == "bfloat16" else torch.float32
    family = {**_recompute(recompute, recompute_layers), **families.family(mc.family).transformer_config(mc)}
    if mc.rope_scaling and not mc.mla:  # YaRN on megatron's plain rotary (model.rope): its attention factor,
        # which transformers multiplies into cos and sin, squared on the softmax scale
        family.update(softmax_scale=yarn_attention_factor(mc) ** 2 / math.sqrt(mc.head_dim))
    if mc.first_k_dense_replace:
        family.update(moe_layer_freq=[0] * mc.first_k_dense_replace + [1] * mc.num_moe_layers)
    if mc.mla:  # transformers' qk_nope_head_dim is megatron's qk_head_dim; MLA's rotary deinterleaves as DeepSeek's
        return MLATransformerConfig(
            q_lora_rank=mc.q_lora_rank or None, kv_lora_rank=mc.kv_lora_rank, qk_head_dim=mc.qk_nope_head_dim,
            qk_pos_emb_head_dim=mc.qk_rope_head_dim, v_head_dim=mc.v_head_dim, rotary_base=mc.rope_theta,
            **_rope(mc), **_common(mc, pc, dtype, **family))
    return TransformerConfig(**_common(mc, pc, dtype, **family))


def _rope(mc: ModelConfig) -> dict:
    """MLA's rotary settings: plain, or YaRN as transformers computes it for DeepSeek-V3. With mscale and
    mscale_all_dim both given, both compute the cos/sin factor as their ratio and the softmax scale's from
    mscale_all_dim; with neither, transformers' factor 0.1 ln(factor) + 1 is megatron's at its defaults mscale=1,
    mscale_all_dim=0 (ModelConfig refuses one without the other, where the two would differ)."""
    y = mc.rope_scaling
    if not y:
        return dict(rope_type="rope")
    both = bool(y.get("mscale") and y.get("mscale_all_dim"))
    return dict(rope_type="yarn", rotary_scaling_factor=y["factor"],
                original_max_position_embeddings=int(y["original_max_position_embeddings"]),
                beta_fast=y.get("beta_fast", 32.0), beta_slow=y.get("beta_slow", 1.0),
                mscale=y["mscale"] if both else 1.0, mscale_all_dim=y["mscale_all_dim"] if both else 0.0)


def _recompute(mode: str, layers: int) -> dict:
    """train.recompute in megatron's fields."""
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=layers)
    if mode != "none":
        raise ValueError(f"recompute={mode!r} is not one of none, selective, full")
    return {}


def _common(mc: ModelConfig, pc: ParallelConfig, dtype: torch.dtype, **family) -> dict:
    return {**dict(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim,
        ffn_hidden_size=mc.intermediate_size or mc.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=mc.rms_norm_eps,
        # megatron's finalize_model_grads sums every q/k-layernorm gradient over TP when this is set: right for
        # per-head norms (replicated weights), wrong for OLMoE's all-heads norms (TP-sharded weights); the spec,
        # not this flag, decides which norms the layers have
        qk_layernorm=mc.qk_norm and not mc.qk_norm_all_heads,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=mc.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=mc.initializer_range,
        num_moe_experts=mc.num_experts,
        moe_router_topk=mc.num_experts_per_tok,
        moe_ffn_hidden_size=mc.moe_intermediate_size,
        moe_router_dtype="fp32",
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=mc.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=mc.shared_expert_gate,
        moe_router_load_balancing_type=mc.moe_router_load_balancing_type,
        moe_aux_loss_coeff=mc.moe_aux_loss_coeff,
        moe_token_dispatcher_type=pc.dispatcher,
        moe_grouped_gemm=mc.spec == "te" and mc.experts == "grouped",  # TE's grouped GEMM; the local spec's is ours
        tensor_model_parallel_size=pc.tp,
        expert_model_parallel_size=pc.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=pc.tp > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        rotary_interleaved=False,
        cuda_graph_scope=[],  # megatron's default, "full", is a deprecated spelling of [] and warns
    ), **family}


def layer_specs(mc: ModelConfig) -> list[ModuleSpec]:
    """One spec per decoder layer: the first_k_dense_replace dense layers, then the MoE layers."""
    moe = layer_spec(mc)
    if not mc.first_k_dense_replace:
        return [moe] * mc.num_hidden_layers
    return [layer_spec(mc, dense=True)] * mc.first_k_dense_replace + [moe] * mc.num_moe_layers


def layer_spec(mc: ModelConfig, dense: bool = False) -> ModuleSpec:
    """The decoder layer spec model.spec names: megatron's local spec with the family's router, an SP-capable
    RMSNorm, and the configured attention and experts; or megatron's TE spec with the family's router (refused,
    naming what is missing, where TE cannot run). dense: the layer's MLP is megatron's dense MLP (no experts)."""
    if mc.spec == "te":
        missing = te_missing()
        if missing:
            raise ConfigError(f"model.spec='te' needs Transformer Engine on CUDA: {missing}; use model.spec=local")
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=mc.num_experts, qk_layernorm=mc.qk_norm,
                                                           moe_grouped_gemm=mc.experts == "grouped")
        # the local spec's checkpoint keys, so that a checkpoint moves between the specs (te_names)
        spec.submodules.sharded_state_dict_keys_map = {**spec.submodules.sharded_state_dict_keys_map,
                                                       **te_names.CHECKPOINT_KEYS}
        spec.submodules.mlp.submodules.router = MoERouter
        return spec
    spec = get_gpt_layer_local_spec(num_experts=None if dense else mc.num_experts,
                                    qk_layernorm=mc.qk_norm or mc.mla, multi_latent_attention=mc.mla,
                                    normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    att = sub.self_attention.submodules
    if mc.mla:  # the query's and the compressed key/value's norms; down projections replicated over TP, whose
        # input gradient megatron's MLA sums over the TP group (its column-parallel path leaves the rotary key's
        # gradient partial: parallel/cpu_compat.py, patch 6)
        att.q_layernorm, att.kv_layernorm = RMSNorm, RMSNorm
        att.linear_q_down_proj = att.linear_kv_down_proj = ReplicatedLinear
    elif mc.qk_norm_all_heads:
        att.q_layernorm, att.k_layernorm = QueryNormAllHeads, KeyNormAllHeads
    elif mc.qk_norm:
        att.q_layernorm, att.k_layernorm = RMSNorm, RMSNorm
    if mc.attention == "sdpa":  # MLA's too: megatron's local core attention takes no separate k/v widths
        att.core_attention = SDPAttention
    if dense:
        return spec
    if mc.experts == "torch":
        sub.mlp.submodules.experts = dataclasses.replace(sub.mlp.submodules.experts, module=TorchLoopExperts)
    elif mc.experts == "grouped":
        sub.mlp.submodules.experts = ModuleSpec(module=GroupedGemmExperts)
    sub.mlp.submodules.router = MoERouter
    return spec
