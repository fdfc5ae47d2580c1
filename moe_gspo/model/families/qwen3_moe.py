"""Qwen3-MoE: per-head RMSNorm on queries and keys, a softmax router (top-k, renormalized when norm_topk_prob).
The package's own layout and tensor names are Qwen3-MoE's."""

from __future__ import annotations

from moe_gspo.model.families.base import Family


class Qwen3Moe(Family):
    name = "qwen3_moe"
    title = "Qwen3-MoE"
    hf_architecture = "Qwen3MoeForCausalLM"
    qk_norm = True
    sglang = True
    upcycles_from = ("qwen3",)

    def upcycle_fields(self, num_experts: int, top_k: int, inter: int) -> dict:
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                    intermediate_size=inter, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    attention_bias=False, output_router_logits=False)


FAMILY = Qwen3Moe()
