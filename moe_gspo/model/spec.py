"""Qwen3-MoE as a megatron-core TransformerConfig and layer spec: megatron's local spec with this package's router,
norms, attention and experts (model.spec='local', anywhere), or megatron's Transformer Engine spec (model.spec='te',
CUDA with transformer_engine)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_gspo.config import ConfigError, ModelConfig, ParallelConfig
from moe_gspo.config.model import check_layout
from moe_gspo.model import te_names
from moe_gspo.model.experts import GroupedGemmExperts
from moe_gspo.model.layers import (KeyNormAllHeads, QueryNormAllHeads, Qwen3Router, RMSNorm, SDPAttention,
                                    TorchLoopExperts)


def te_missing() -> str | None:
    """Why the Transformer Engine spec cannot run here (None when it can): TE is CUDA-only."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means TE cannot run; say which
        return f"transformer_engine does not import ({type(e).__name__}: {e})"
    return None


def transformer_config(mc: ModelConfig, pc: ParallelConfig) -> TransformerConfig:
    """Megatron's config for the Qwen3-MoE architecture (see docs/architecture.md for each choice)."""
    check_layout(mc, pc)
    dtype = torch.bfloat16 if mc.params_dtype == "bfloat16" else torch.float32
    return TransformerConfig(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim,
        ffn_hidden_size=mc.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=mc.rms_norm_eps,
        qk_layernorm=mc.qk_norm,
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
        moe_shared_expert_gate=bool(mc.shared_expert_intermediate_size),
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
    )


def layer_spec(mc: ModelConfig) -> ModuleSpec:
    """The decoder layer spec model.spec names: megatron's local spec with Qwen3's router, an SP-capable RMSNorm,
    and the configured attention and experts; or megatron's TE spec with Qwen3's router (refused, naming what is
    missing, where TE cannot run)."""
    if mc.spec == "te":
        missing = te_missing()
        if missing:
            raise ConfigError(f"model.spec='te' needs Transformer Engine on CUDA: {missing}; use model.spec=local")
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=mc.num_experts, qk_layernorm=mc.qk_norm,
                                                           moe_grouped_gemm=mc.experts == "grouped")
        # the local spec's checkpoint keys, so that a checkpoint moves between the specs (te_names)
        spec.submodules.sharded_state_dict_keys_map = {**spec.submodules.sharded_state_dict_keys_map,
                                                       **te_names.CHECKPOINT_KEYS}
    else:
        spec = get_gpt_layer_local_spec(num_experts=mc.num_experts, qk_layernorm=mc.qk_norm,
                                        normalization="RMSNorm")
        sub = spec.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if mc.qk_norm_all_heads:
            sub.self_attention.submodules.q_layernorm = QueryNormAllHeads
            sub.self_attention.submodules.k_layernorm = KeyNormAllHeads
        elif mc.qk_norm:
            sub.self_attention.submodules.q_layernorm = RMSNorm
            sub.self_attention.submodules.k_layernorm = RMSNorm
        if mc.attention == "sdpa":
            sub.self_attention.submodules.core_attention = SDPAttention
        if mc.experts == "torch":
            sub.mlp.submodules.experts = dataclasses.replace(sub.mlp.submodules.experts, module=TorchLoopExperts)
        elif mc.experts == "grouped":
            sub.mlp.submodules.experts = ModuleSpec(module=GroupedGemmExperts)
    spec.submodules.mlp.submodules.router = Qwen3Router
    return spec
