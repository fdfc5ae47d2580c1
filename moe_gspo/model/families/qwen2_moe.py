"""Qwen2-MoE: no query/key norm, biases on q/k/v (config.json's qkv_bias), and a shared expert beside the routed
ones whose output is scaled by sigmoid(gate . x)."""

from __future__ import annotations

from moe_gspo.model.families.base import Family


class Qwen2Moe(Family):
    name = "qwen2_moe"
    title = "Qwen2-MoE"
    hf_architecture = "Qwen2MoeForCausalLM"
    uses = frozenset({"attention_bias", "shared_expert_intermediate_size"})
    shared_expert_gate = True
    vllm_head_dim_from_hidden = True
    upcycles_from = ("llama", "mistral", "qwen2")
    upcycle_shared_expert = True

    def from_hf(self, c: dict, where) -> dict:
        return {**super().from_hf(c, where),
                "shared_expert_intermediate_size": int(c.get("shared_expert_intermediate_size") or 0),
                "attention_bias": bool(c.get("qkv_bias", True))}

    def to_hf(self, mc, common: dict) -> dict:
        out = super().to_hf(mc, common)
        del out["attention_bias"]
        return {**out, "qkv_bias": mc.attention_bias}

    def upcycle_fields(self, num_experts: int, top_k: int, inter: int) -> dict:
        # the dense MLP becomes the shared expert, at the same width
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                    intermediate_size=inter, shared_expert_intermediate_size=inter, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True, use_sliding_window=False,
                    output_router_logits=False)


FAMILY = Qwen2Moe()
