"""OLMoE: one RMSNorm over all heads of the queries and one over all heads of the keys; top-k probabilities not
renormalized by default."""

from __future__ import annotations

from moe_gspo.model.families.base import Family, FamilyError


class Olmoe(Family):
    name = "olmoe"
    title = "OLMoE"
    hf_architecture = "OlmoeForCausalLM"
    qk_norm = True
    qk_norm_all_heads = True
    vllm_rms_norm_eps = 1e-5  # vLLM 0.32's OLMoE hard-codes the released checkpoints' value
    vllm_head_dim_from_hidden = True

    def check(self, mc) -> None:
        if mc.num_attention_heads * mc.head_dim != mc.hidden_size:
            raise FamilyError(f"model.head_dim={mc.head_dim} with model.family='olmoe': OLMoE's query norm is "
                              f"hidden_size={mc.hidden_size} wide in transformers and vLLM, so num_attention_heads x "
                              f"head_dim must equal it (head_dim={mc.hidden_size // mc.num_attention_heads})")

    def from_hf(self, c: dict, where) -> dict:  # its experts' width is intermediate_size
        return dict(num_experts=c["num_experts"], moe_intermediate_size=c["intermediate_size"],
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)))

    def to_hf(self, mc, common: dict) -> dict:
        return {**common, "num_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "norm_topk_prob": mc.norm_topk_prob, "clip_qkv": None, "attention_bias": False}


FAMILY = Olmoe()
